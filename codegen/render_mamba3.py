"""Triton source of the Mamba-3 SISO scan, forward and backward, for one region.

Layout the launcher (``mamba3_kernels``) provides: x, z, y, dx, dz dense (batch, seq, heads,
headdim); B, C dense (batch, seq, groups, dstate); dt, adt, trap dense (batch, seq, heads);
angles dense (batch, seq, heads, n_angles); states as in the op.  One program per (batch, head,
block of BP headdim rows); its (BP, dstate) state lives in fp32 registers as two halves, the even and the odd state columns, so that rotating the pairs
(2i, 2i+1) by theta_i is elementwise: k_e' = k_e cos - k_o sin, k_o' = k_e sin + k_o cos.
Per-step scalars (dt, adt, trap) are loaded as vectors of identical lanes over the pair axis.

Forward step t:  theta += pi tanh(angles_t) dt_t (mod 2 pi);  k_t, q_t = R(theta)(B_t + B_bias),
R(theta)(C_t + C_bias);  S = alpha S + beta x_{t-1} k_{t-1}^T + gamma x_t k_t^T with alpha =
exp(adt), beta = (1 - lam) dt alpha, gamma = lam dt, lam = sigmoid(trap);  y = (S q + D x) silu(z).
Backward: per chunk (last first) recompute the states from the checkpoint into scratch, then
run the adjoint recurrence backwards; gradients of the previous step's key/value are carried
one step ("pending"), the angle gradient is a reverse running sum.  Everything the backward sums
over headdim is linear in the per-block sums, so each block writes its own slice of those
outputs and the launcher adds them.
"""
from __future__ import annotations

from mambac.codegen.render_mamba3_common import (Key, Mamba3Source, advance_angle, consts, headdim_block_partials,
                                                 load_checkpoint, load_key, load_state_grads, mixing, rotate,
                                                 shift, step_loads, store_bc_grads, store_dD, store_initial_grads,
                                                 store_key, store_step_grads)
from mambac.codegen.render_scan_common import silu_gate, skip_gate_store
from mambac.codegen.scan_ir import Mamba3SisoRegion
from mambac.codegen.writer import Writer

FWD = "mamba3_siso_fwd"
BWD = "mamba3_siso_bwd"
KEY = Key("", "hb * N", "ci * N")  # the one key: ke/ko, (batch, heads, dstate) states


class _Siso(Mamba3Source):
    FWD, BWD = FWD, BWD
    SIZES = ["L", "H", "G", "HPG", "P", "N", "S", "NC"]
    NOTE_LAST_X = True

    def inputs(self) -> list[str]:
        r = self.r
        out = ["x_ptr", "B_ptr", "C_ptr", "dt_ptr", "adt_ptr", "trap_ptr", "ang_ptr"]
        return out + [n for n, on in (("Bb_ptr", r.has_B_bias), ("Cb_ptr", r.has_C_bias), ("D_ptr", r.has_D),
                                      ("z_ptr", r.has_z)) if on]

    def keys(self) -> list[Key]:
        return [KEY]

    def lanes(self, w: Writer) -> None:
        """Even / odd state columns; the B/C biases of the head."""
        w.lines("m_p = offs_p < P", "offs_i = tl.arange(0, NH)", "ne = 2 * offs_i", "no = ne + 1",
                "m_e = ne < N", "m_o = no < N", "m_a = offs_i < S", "lane0 = offs_i == 0",
                "me2 = m_p[:, None] & m_e[None, :]", "mo2 = m_p[:, None] & m_o[None, :]",
                "hb = bi * H + hi  # flat (batch, head)")
        for name, on, ptr in (("Bb", self.r.has_B_bias, "Bb_ptr"), ("Cb", self.r.has_C_bias, "Cb_ptr")):
            if on:
                w.line(f"{name}e = tl.load({ptr} + hi * N + ne, mask=m_e, other=0.0).to(tl.float32)")
                w.line(f"{name}o = tl.load({ptr} + hi * N + no, mask=m_o, other=0.0).to(tl.float32)")

    def describe_forward(self) -> str:
        return "Sequential Mamba-3 SISO scan, state in fp32 registers as even/odd column halves"

    def store_checkpoint_keys(self, w: Writer) -> None:
        store_key(w, "ck_ptr", KEY.ckpt, "kp", KEY)
        w.line("tl.store(cx_ptr + ci * P + offs_p, xp, mask=m_p)")

    def forward_step(self, w: Writer) -> None:
        _step_inputs(w, self.r)
        _advance(w)

    def outputs(self, w: Writer) -> None:
        w.line("y = tl.sum(Se * qe[None, :], axis=1) + tl.sum(So * qo[None, :], axis=1)")
        skip_gate_store(w, self.r, "xv", "sidx * P + offs_p", "tp", "y_ptr")


def _step_inputs(w: Writer, r: Mamba3SisoRegion) -> None:
    """Loads of step t and the biased B_t, C_t; padded steps load zeros (alpha 1, no input)."""
    step_loads(w)
    w.line("bidx = ((bi * L + t) * G + gi) * N")
    for M, bias, on in (("B", "Bb", r.has_B_bias), ("C", "Cb", r.has_C_bias)):
        for hf, lanes, m in (("e", "ne", "m_e"), ("o", "no", "m_o")):
            w.line(f"{M.lower()}b{hf} = tl.load({M}_ptr + bidx + {lanes}, mask={m} & tv, other=0.0)"
                   f".to(tl.float32)" + (f" + {bias}{hf}" if on else ""))
    mixing(w)


def _rotate(w: Writer) -> None:
    w.lines("cs = tl.cos(theta)", "sn = tl.sin(theta)")
    rotate(w, KEY)


def _advance(w: Writer) -> None:
    """theta_t and k_t, q_t, then S_t from S_{t-1}."""
    advance_angle(w)
    _rotate(w)
    _update(w, "S")


def _update(w: Writer, src: str) -> None:
    """S_t (Se, So) from S_{t-1} (``src``e, ``src``o), the previous and the current key/value."""
    for hf in "eo":
        w.line(f"S{hf} = alpha[None, :] * {src}{hf} + xp[:, None] * (beta * kp{hf})[None, :] "
               f"+ xv[:, None] * (gamma * k{hf})[None, :]")


def render_forward(r: Mamba3SisoRegion, *, with_out: bool = True, checkpoints: bool = False) -> str:
    return _Siso(r).render_forward(with_out, checkpoints)


def render_backward(r: Mamba3SisoRegion) -> str:
    w = Writer()
    src = _Siso(r)
    with src.backward_signature(w, "Reverse-chunk adjoint of the Mamba-3 SISO scan; states recomputed per chunk "
                                   "from checkpoints into scratch.",
                                [n for n, on in (("dD_ptr", r.has_D), ("dz_ptr", r.has_z)) if on]):
        consts(w)
        src.prologue(w, p_block=True)
        w.line("SZ = 2 * BP * NH + 4 * NH + BP  # scratch floats per step")
        headdim_block_partials(w, r, "N", "H * N")
        load_state_grads(w)
        load_key(w, "pk", "gk_ptr", KEY.state, KEY, " & first")
        w.lines("pxv = tl.load(gv_ptr + hb * P + offs_p, mask=m_p, other=0.0)",
                "dD_acc = tl.zeros((BP,), dtype=tl.float32)")
        with w.block("for cc in range(0, NC):"):
            load_checkpoint(w)
            load_key(w, "kp", "ck_ptr", KEY.ckpt, KEY)
            w.line("xp = tl.load(cx_ptr + ci * P + offs_p, mask=m_p, other=0.0)")
            w.comment("recompute: scratch step i = (S_e, S_o before step i, k_{t-1}, x_{t-1}, theta_t)")
            with w.block("for i in range(0, T):"):
                w.lines("t = c * T + i", "sc = scr_ptr + i * SZ")
                _step_inputs(w, r)
                w.lines("tl.store(sc + pp2, Se)", "tl.store(sc + BP * NH + pp2, So)",
                        "tl.store(sc + 2 * BP * NH + offs_i, kpe)", "tl.store(sc + 2 * BP * NH + NH + offs_i, kpo)",
                        "tl.store(sc + 2 * BP * NH + 2 * NH + lp, xp)")
                _advance(w)
                w.line("tl.store(sc + 2 * BP * NH + 2 * NH + BP + offs_i, theta)")
                shift(w, [KEY])
            w.comment("adjoint, last step first; G = dLoss/dS_t")
            with w.block("for ii in range(0, T):"):
                w.lines("i = T - 1 - ii", "t = c * T + i", "sc = scr_ptr + i * SZ")
                _step_inputs(w, r)
                w.lines("Spe = tl.load(sc + pp2)", "Spo = tl.load(sc + BP * NH + pp2)",
                        "kpe = tl.load(sc + 2 * BP * NH + offs_i)", "kpo = tl.load(sc + 2 * BP * NH + NH + offs_i)",
                        "xp = tl.load(sc + 2 * BP * NH + 2 * NH + lp)",
                        "theta = tl.load(sc + 2 * BP * NH + 2 * NH + BP + offs_i)")
                _rotate(w)
                _update(w, "Sp")
                w.line("go = tl.load(gy_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
                if r.has_z:
                    w.line("ypre = tl.sum(Se * qe[None, :], axis=1) + tl.sum(So * qo[None, :], axis=1)"
                           + (" + Dv * xv" if r.has_D else ""))
                    w.line("zv = tl.load(z_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
                    silu_gate(w, "zv", grad=True)
                    w.line("tl.store(dz_ptr + sidx * P + offs_p, go * ypre * dsilu, mask=tp)")
                    w.line("gyp = go * silu")
                else:
                    w.line("gyp = go")
                if r.has_D:
                    w.lines("dD_acc += gyp * xv", "dxv = gyp * Dv + pxv")
                else:
                    w.line("dxv = pxv")
                w.lines("dqe = tl.sum(Se * gyp[:, None], axis=0)", "dqo = tl.sum(So * gyp[:, None], axis=0)",
                        "Ge = Ge + gyp[:, None] * qe[None, :]", "Go = Go + gyp[:, None] * qo[None, :]",
                        "dalpha = tl.sum(Ge * Spe) + tl.sum(Go * Spo)",
                        "Gk = tl.sum(Ge * ke[None, :], axis=1) + tl.sum(Go * ko[None, :], axis=1)",
                        "Gkp = tl.sum(Ge * kpe[None, :], axis=1) + tl.sum(Go * kpo[None, :], axis=1)",
                        "dbeta = tl.sum(xp * Gkp)", "dgamma = tl.sum(xv * Gk)",
                        "gam_s = tl.sum(tl.where(lane0, gamma, 0.0))  # the step's scalars, for headdim vectors",
                        "bet_s = tl.sum(tl.where(lane0, beta, 0.0))",
                        "dxv += gam_s * Gk",
                        "dke = tl.where(tv, gamma * tl.sum(Ge * xv[:, None], axis=0) + pke, 0.0)",
                        "dko = tl.where(tv, gamma * tl.sum(Go * xv[:, None], axis=0) + pko, 0.0)",
                        "pke = tl.where(tv, beta * tl.sum(Ge * xp[:, None], axis=0), pke)",
                        "pko = tl.where(tv, beta * tl.sum(Go * xp[:, None], axis=0), pko)",
                        "pxv = tl.where(tp, bet_s * Gkp, pxv)",
                        "Ge = alpha[None, :] * Ge", "Go = alpha[None, :] * Go",
                        "gth += tl.where(m_a, dko * ke - dke * ko + dqo * qe - dqe * qo, 0.0)",
                        "dbv = (bi * L + t) * H * N + hi * N")
                store_bc_grads(w, "dbv", KEY)
                w.lines("tl.store(dang_ptr + sidx * S + offs_i, gth * PI * (1.0 - tang * tang) * dtv, mask=m_a & tv)",
                        "dth_dt = tl.sum(gth * PI * tang)",
                        "ddt = dbeta * (1.0 - lam) * alpha + dgamma * lam + dth_dt")
                store_step_grads(w)
        store_initial_grads(w)
        store_key(w, "dik_ptr", KEY.state, "pk", KEY)
        w.line("tl.store(div_ptr + hb * P + offs_p, pxv, mask=m_p)")
        store_dD(w, r)
    return w.source()
