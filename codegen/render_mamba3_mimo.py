"""Triton source of the Mamba-3 MIMO scan (rank r), forward and backward, for one region.

Same scheme as ``render_mamba3`` (one program per (batch, head), fp32 state in registers,
checkpoints per chunk, reverse-chunk adjoint over recomputed states), with two differences: the
rank is unrolled in the source (every per-rank key, query, value and parameter is its own
variable), and the rotation pairs are (i, i + n/2), so the state halves are the first and the
second half of the state columns ("lo"/"hi", named e/o as in the SISO kernels).

Layout: x, z dense (batch, seq, heads, headdim); B, C dense (batch, seq, rank, groups, dstate);
B_bias, C_bias (heads, rank, dstate); mimo_x/z/o (heads, rank, headdim); y (batch, seq, heads,
headdim) with mimo_o, else (batch, seq, rank, heads, headdim); k states (batch, rank, heads, dstate).
"""
from __future__ import annotations

from mambac.codegen.render_mamba3_common import (Key, Mamba3Source, advance_angle, consts, headdim_block_partials,
                                                 load_checkpoint, load_key, load_state_grads, mixing, rotate,
                                                 shift, step_loads, store_bc_grads, store_dD, store_initial_grads,
                                                 store_key, store_step_grads)
from mambac.codegen.render_scan_common import to_out
from mambac.codegen.scan_ir import Mamba3MimoRegion
from mambac.codegen.writer import Writer

FWD = "mamba3_mimo_fwd"
BWD = "mamba3_mimo_bwd"


def _kidx(r: Mamba3MimoRegion, k: int) -> str:
    """Offset of rank k's key in a (batch, rank, heads, dstate) state."""
    return f"((bi * {r.rank} + {k}) * H + hi) * N"


def _keys(r: Mamba3MimoRegion) -> list[Key]:
    """One key per rank: ke0/ko0, ke1/ko1, ..."""
    return [Key(str(k), _kidx(r, k), f"(ci * {r.rank} + {k}) * N") for k in range(r.rank)]


class _Mimo(Mamba3Source):
    FWD, BWD = FWD, BWD
    SIZES = ["L", "H", "G", "HPG", "P", "N", "N2", "S", "NC"]

    def inputs(self) -> list[str]:
        r = self.r
        out = ["x_ptr", "B_ptr", "C_ptr", "dt_ptr", "adt_ptr", "trap_ptr", "ang_ptr", "ux_ptr"]
        return out + [n for n, on in (("Bb_ptr", r.has_B_bias), ("Cb_ptr", r.has_C_bias), ("uz_ptr", r.has_z),
                                      ("uo_ptr", r.has_mimo_o), ("D_ptr", r.has_D), ("z_ptr", r.has_z)) if on]

    def keys(self) -> list[Key]:
        return _keys(self.r)

    def lanes(self, w: Writer) -> None:
        """First / second half of the state columns; per-rank x/z/o weights and B/C biases of the head."""
        r = self.r
        w.lines("m_p = offs_p < P", "offs_i = tl.arange(0, NH)", "ne = offs_i", "no = N2 + offs_i",
                "m_e = offs_i < N2", "m_o = m_e", "m_a = offs_i < S", "lane0 = offs_i == 0",
                "me2 = m_p[:, None] & m_e[None, :]", "mo2 = me2", "hb = bi * H + hi  # flat (batch, head)")
        for k in range(r.rank):
            params = [("ux", True)] + [("uz", r.has_z), ("uo", r.has_mimo_o)]
            for name, on in params:
                if on:
                    w.line(f"{name}{k} = tl.load({name}_ptr + (hi * {r.rank} + {k}) * P + offs_p, mask=m_p, "
                           f"other=0.0).to(tl.float32)")
            for name, on in (("Bb", r.has_B_bias), ("Cb", r.has_C_bias)):
                if on:
                    for hf in "eo":
                        w.line(f"{name}{hf}{k} = tl.load({name}_ptr + (hi * {r.rank} + {k}) * N + n{hf}, "
                               f"mask=m_{hf}, other=0.0).to(tl.float32)")

    def describe_forward(self) -> str:
        return f"Sequential Mamba-3 MIMO scan of rank {self.r.rank}, state in fp32 registers"

    def store_checkpoint_keys(self, w: Writer) -> None:
        w.line("tl.store(cx_ptr + ci * P + offs_p, xp, mask=m_p)")
        for k in self.keys():
            store_key(w, "ck_ptr", k.ckpt, "kp", k)

    def forward_step(self, w: Writer) -> None:
        _step(w, self.r, advance=True)
        _update(w, self.r, "S")

    def outputs(self, w: Writer) -> None:
        r = self.r
        if r.has_z:
            w.line("zv = tl.load(z_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
        if r.has_mimo_o:
            w.line("y = tl.zeros((BP,), dtype=tl.float32)")
        for k in range(r.rank):
            w.line(f"o = {_ypre(r, k)}")
            if r.has_z:
                w.lines(f"a = uz{k} * zv", "o = o * a * tl.sigmoid(a)")
            if r.has_mimo_o:
                w.line(f"y += uo{k} * o")
            else:
                w.line(f"tl.store(y_ptr + {_yidx(r, k)}, {to_out(r, 'y_ptr', 'o')}, mask=tp)")
        if r.has_mimo_o:
            w.line(f"tl.store(y_ptr + sidx * P + offs_p, {to_out(r, 'y_ptr', 'y')}, mask=tp)")


def _step(w: Writer, r: Mamba3MimoRegion, advance: bool) -> None:
    """Loads of step t, theta_t (advanced from theta_{t-1} when ``advance``), rotated keys and
    queries of every rank, the step's decay/mixing scalars."""
    step_loads(w)
    if advance:
        advance_angle(w)
    w.lines("cs = tl.cos(theta)", "sn = tl.sin(theta)")
    for k in _keys(r):
        w.line(f"bidx = (((bi * L + t) * {r.rank} + {k.suffix}) * G + gi) * N")
        for M, bias, on in (("B", "Bb", r.has_B_bias), ("C", "Cb", r.has_C_bias)):
            for hf in "eo":
                w.line(f"{M.lower()}b{hf} = tl.load({M}_ptr + bidx + n{hf}, mask=m_{hf} & tv, other=0.0)"
                       f".to(tl.float32)" + (f" + {bias}{hf}{k.suffix}" if on else ""))
        rotate(w, k)
    mixing(w)


def _update(w: Writer, r: Mamba3MimoRegion, src: str) -> None:
    """S_t (Se, So) from S_{t-1} (``src``e, ``src``o), the previous and the current keys/values."""
    for hf in "eo":
        w.line(f"S{hf} = alpha[None, :] * {src}{hf}")
        for k in range(r.rank):
            w.line(f"S{hf} += (ux{k} * xp)[:, None] * (beta * kp{hf}{k})[None, :] "
                   f"+ (ux{k} * xv)[:, None] * (gamma * k{hf}{k})[None, :]")


def _ypre(r: Mamba3MimoRegion, k: int) -> str:
    d = f" + Dv * ux{k} * xv" if r.has_D else ""
    return f"tl.sum(Se * qe{k}[None, :], axis=1) + tl.sum(So * qo{k}[None, :], axis=1){d}"


def _yidx(r: Mamba3MimoRegion, k: int) -> str:
    if r.has_mimo_o:
        return "sidx * P + offs_p"
    return f"(((bi * L + t) * {r.rank} + {k}) * H + hi) * P + offs_p"


def render_forward(r: Mamba3MimoRegion, *, with_out: bool = True, checkpoints: bool = False) -> str:
    return _Mimo(r).render_forward(with_out, checkpoints)


def render_backward(r: Mamba3MimoRegion) -> str:
    w = Writer()
    R_, keys = r.rank, _keys(r)
    grads = ["dux_ptr"] + [n for n, on in (("duz_ptr", r.has_z), ("duo_ptr", r.has_mimo_o), ("dD_ptr", r.has_D),
                                           ("dz_ptr", r.has_z)) if on]
    src = _Mimo(r)
    with src.backward_signature(w, f"Reverse-chunk adjoint of the Mamba-3 MIMO scan of rank {R_}; states "
                                   "recomputed per chunk from checkpoints into scratch.", grads):
        consts(w)
        src.prologue(w, p_block=True)
        w.line(f"SZ = 2 * BP * NH + {2 * R_} * NH + BP + NH  # scratch floats per step")
        headdim_block_partials(w, r, f"{R_} * N", f"{R_} * H * N")
        load_state_grads(w)
        w.lines("pxv = tl.load(gv_ptr + hb * P + offs_p, mask=m_p, other=0.0)",
                "dD_acc = tl.zeros((BP,), dtype=tl.float32)")
        for k in keys:
            load_key(w, "pk", "gk_ptr", k.state, k, " & first")
            for name, on in (("dux", True), ("duz", r.has_z), ("duo", r.has_mimo_o)):
                if on:
                    w.line(f"{name}{k.suffix} = tl.zeros((BP,), dtype=tl.float32)")
        with w.block("for cc in range(0, NC):"):
            load_checkpoint(w)
            w.line("xp = tl.load(cx_ptr + ci * P + offs_p, mask=m_p, other=0.0)")
            for k in keys:
                load_key(w, "kp", "ck_ptr", k.ckpt, k)
            w.comment("recompute: scratch step i = (S before step i, previous keys, x_{t-1}, theta_t)")
            with w.block("for i in range(0, T):"):
                w.lines("t = c * T + i", "sc = scr_ptr + i * SZ")
                w.lines("tl.store(sc + pp2, Se)", "tl.store(sc + BP * NH + pp2, So)",
                        "tl.store(sc + 2 * BP * NH + lp, xp)")
                for k in range(R_):
                    for j, hf in enumerate("eo"):
                        w.line(f"tl.store(sc + 2 * BP * NH + BP + {2 * k + j} * NH + offs_i, kp{hf}{k})")
                _step(w, r, advance=True)
                _update(w, r, "S")
                w.line(f"tl.store(sc + 2 * BP * NH + BP + {2 * R_} * NH + offs_i, theta)")
                shift(w, keys)
            w.comment("adjoint, last step first; G = dLoss/dS_t")
            with w.block("for ii in range(0, T):"):
                w.lines("i = T - 1 - ii", "t = c * T + i", "sc = scr_ptr + i * SZ",
                        "Spe = tl.load(sc + pp2)", "Spo = tl.load(sc + BP * NH + pp2)",
                        "xp = tl.load(sc + 2 * BP * NH + lp)",
                        f"theta = tl.load(sc + 2 * BP * NH + BP + {2 * R_} * NH + offs_i)")
                for k in range(R_):
                    for j, hf in enumerate("eo"):
                        w.line(f"kp{hf}{k} = tl.load(sc + 2 * BP * NH + BP + {2 * k + j} * NH + offs_i)")
                _step(w, r, advance=False)
                _update(w, r, "Sp")
                _adjoint_step(w, r)
        _final_stores(w, r)
    return w.source()


def _adjoint_step(w: Writer, r: Mamba3MimoRegion) -> None:
    R_ = r.rank
    if r.has_mimo_o:
        w.line("gyv = tl.load(gy_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
    if r.has_z:
        w.lines("zv = tl.load(z_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)",
                "dzv = tl.zeros((BP,), dtype=tl.float32)")
    w.lines("dxv = pxv", "pxn = tl.zeros((BP,), dtype=tl.float32)")
    for k in range(R_):
        w.line(f"go = uo{k} * gyv" if r.has_mimo_o else
               f"go = tl.load(gy_ptr + {_yidx(r, k)}, mask=tp, other=0.0).to(tl.float32)")
        w.line(f"o = {_ypre(r, k)}")
        if r.has_z:
            w.lines(f"a = uz{k} * zv", "sg = tl.sigmoid(a)", "tz = go * o * sg * (1.0 + a * (1.0 - sg))",
                    f"dzv += tz * uz{k}", f"duz{k} += tz * zv", "o = o * a * sg", "go = go * a * sg")
        if r.has_mimo_o:
            w.line(f"duo{k} += gyv * o")
        if r.has_D:
            w.lines(f"dD_acc += go * ux{k} * xv", f"dv{k} = go * Dv")
        else:
            w.line(f"dv{k} = tl.zeros((BP,), dtype=tl.float32)")
        w.lines(f"dqe{k} = tl.sum(Se * go[:, None], axis=0)", f"dqo{k} = tl.sum(So * go[:, None], axis=0)",
                f"Ge = Ge + go[:, None] * qe{k}[None, :]", f"Go = Go + go[:, None] * qo{k}[None, :]")
    if r.has_z:
        w.line("tl.store(dz_ptr + sidx * P + offs_p, dzv, mask=tp)")
    w.lines("dalpha = tl.sum(Ge * Spe) + tl.sum(Go * Spo)",
            "gam_s = tl.sum(tl.where(lane0, gamma, 0.0))  # the step's scalars, for headdim vectors",
            "bet_s = tl.sum(tl.where(lane0, beta, 0.0))", "dgamma = 0.0", "dbeta = 0.0",
            "dth = tl.zeros((NH,), dtype=tl.float32)", "dbv = (bi * L + t) * " + f"{R_} * H * N")
    for key in _keys(r):
        k = key.suffix
        w.lines(f"vr = ux{k} * xv", f"vpr = ux{k} * xp",
                f"Gk = tl.sum(Ge * ke{k}[None, :], axis=1) + tl.sum(Go * ko{k}[None, :], axis=1)",
                f"Gkp = tl.sum(Ge * kpe{k}[None, :], axis=1) + tl.sum(Go * kpo{k}[None, :], axis=1)",
                "dgamma += tl.sum(vr * Gk)", "dbeta += tl.sum(vpr * Gkp)",
                f"dv{k} += gam_s * Gk", f"dxv += ux{k} * dv{k}",
                f"dux{k} += dv{k} * xv + bet_s * Gkp * xp", f"pxn += ux{k} * bet_s * Gkp",
                f"dke = tl.where(tv, gamma * tl.sum(Ge * vr[:, None], axis=0) + pke{k}, 0.0)",
                f"dko = tl.where(tv, gamma * tl.sum(Go * vr[:, None], axis=0) + pko{k}, 0.0)",
                f"pke{k} = tl.where(tv, beta * tl.sum(Ge * vpr[:, None], axis=0), pke{k})",
                f"pko{k} = tl.where(tv, beta * tl.sum(Go * vpr[:, None], axis=0), pko{k})",
                f"dth += dko * ke{k} - dke * ko{k} + dqo{k} * qe{k} - dqe{k} * qo{k}",
                f"kb = dbv + ({k} * H + hi) * N")
        store_bc_grads(w, "kb", key)
    w.lines("pxv = tl.where(tp, pxn, pxv)", "Ge = alpha[None, :] * Ge", "Go = alpha[None, :] * Go",
            "gth += tl.where(m_a, dth, 0.0)",
            "tl.store(dang_ptr + sidx * S + offs_i, gth * PI * (1.0 - tang * tang) * dtv, mask=m_a & tv)",
            "ddt = dbeta * (1.0 - lam) * alpha + dgamma * lam + tl.sum(gth * PI * tang)")
    store_step_grads(w)


def _final_stores(w: Writer, r: Mamba3MimoRegion) -> None:
    store_initial_grads(w)
    w.line("tl.store(div_ptr + hb * P + offs_p, pxv, mask=m_p)")
    for k in _keys(r):
        store_key(w, "dik_ptr", k.state, "pk", k)
        for name, on in (("dux", True), ("duz", r.has_z), ("duo", r.has_mimo_o)):
            if on:
                w.line(f"tl.store({name}_ptr + (hb * {r.rank} + {k.suffix}) * P + offs_p, {name}{k.suffix}, "
                       "mask=m_p)")
    store_dD(w, r)
