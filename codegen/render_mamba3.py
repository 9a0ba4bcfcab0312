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

from mambac.codegen.render_scan_common import header, silu_gate, to_out
from mambac.codegen.scan_ir import Mamba3SisoRegion
from mambac.codegen.writer import Writer

FWD = "mamba3_siso_fwd"
BWD = "mamba3_siso_bwd"
SIZES = ["L", "H", "G", "HPG", "P", "N", "S", "NC"]
CONSTS = ["BP: tl.constexpr", "NH: tl.constexpr", "T: tl.constexpr"]


def _inputs(r: Mamba3SisoRegion) -> list[str]:
    out = ["x_ptr", "B_ptr", "C_ptr", "dt_ptr", "adt_ptr", "trap_ptr", "ang_ptr"]
    return out + [n for n, on in (("Bb_ptr", r.has_B_bias), ("Cb_ptr", r.has_C_bias), ("D_ptr", r.has_D),
                                  ("z_ptr", r.has_z)) if on]


def _inits(r: Mamba3SisoRegion) -> list[str]:
    return [n for n, on in (("ia_ptr", r.init_angle), ("is_ptr", r.init_ssm), ("ik_ptr", r.init_k),
                            ("iv_ptr", r.init_v)) if on]


def _prologue(w: Writer, r: Mamba3SisoRegion, p_block: bool) -> None:
    w.lines("pid = tl.program_id(0)", "bi = (pid // H).to(tl.int64)", "hi = pid % H", "gi = hi // HPG")
    w.line("offs_p = tl.program_id(1) * BP + tl.arange(0, BP)" if p_block else "offs_p = tl.arange(0, BP)")
    w.lines("m_p = offs_p < P", "offs_i = tl.arange(0, NH)", "ne = 2 * offs_i", "no = ne + 1",
            "m_e = ne < N", "m_o = no < N", "m_a = offs_i < S", "lane0 = offs_i == 0",
            "me2 = m_p[:, None] & m_e[None, :]", "mo2 = m_p[:, None] & m_o[None, :]",
            "hb = bi * H + hi  # flat (batch, head)")
    for name, on, ptr in (("Bb", r.has_B_bias, "Bb_ptr"), ("Cb", r.has_C_bias, "Cb_ptr")):
        if on:
            w.line(f"{name}e = tl.load({ptr} + hi * N + ne, mask=m_e, other=0.0).to(tl.float32)")
            w.line(f"{name}o = tl.load({ptr} + hi * N + no, mask=m_o, other=0.0).to(tl.float32)")
    if r.has_D:
        w.line("Dv = tl.load(D_ptr + hi).to(tl.float32)")


def _init_state(w: Writer, r: Mamba3SisoRegion) -> None:
    z2 = "tl.zeros((BP, NH), dtype=tl.float32)"
    if r.init_ssm:
        for hf, lanes, m in (("e", "ne", "me2"), ("o", "no", "mo2")):
            w.line(f"S{hf} = tl.load(is_ptr + hb * P * N + offs_p[:, None] * N + {lanes}[None, :], "
                   f"mask={m}, other=0.0).to(tl.float32)")
    else:
        w.lines(f"Se = {z2}", f"So = {z2}")
    w.line("theta = " + ("tl.load(ia_ptr + hb * S + offs_i, mask=m_a, other=0.0).to(tl.float32)"
                         if r.init_angle else "tl.zeros((NH,), dtype=tl.float32)"))
    if r.init_k:
        w.line("kpe = tl.load(ik_ptr + hb * N + ne, mask=m_e, other=0.0).to(tl.float32)")
        w.line("kpo = tl.load(ik_ptr + hb * N + no, mask=m_o, other=0.0).to(tl.float32)")
    else:
        w.lines("kpe = tl.zeros((NH,), dtype=tl.float32)", "kpo = tl.zeros((NH,), dtype=tl.float32)")
    w.line("xp = " + ("tl.load(iv_ptr + hb * P + offs_p, mask=m_p, other=0.0).to(tl.float32)"
                      if r.init_v else "tl.zeros((BP,), dtype=tl.float32)"))


def _step_inputs(w: Writer, r: Mamba3SisoRegion) -> None:
    """Loads of step t and the rotated key / query; padded steps load zeros (alpha 1, no input)."""
    w.lines("tv = offs_i * 0 + t < L", "tp = m_p & (offs_p * 0 + t < L)", "sidx = (bi * L + t) * H + hi",
            "dtv = tl.load(dt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "adtv = tl.load(adt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "trv = tl.load(trap_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "ang = tl.load(ang_ptr + sidx * S + offs_i, mask=tv & m_a, other=0.0).to(tl.float32)",
            "tang = _tanh(ang)",
            "xv = tl.load(x_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)",
            "bidx = ((bi * L + t) * G + gi) * N")
    for M, bias, on in (("B", "Bb", r.has_B_bias), ("C", "Cb", r.has_C_bias)):
        for hf, lanes, m in (("e", "ne", "m_e"), ("o", "no", "m_o")):
            w.line(f"{M.lower()}b{hf} = tl.load({M}_ptr + bidx + {lanes}, mask={m} & tv, other=0.0)"
                   f".to(tl.float32)" + (f" + {bias}{hf}" if on else ""))
    w.lines("alpha = tl.exp(adtv)", "lam = tl.sigmoid(trv)", "beta = (1.0 - lam) * dtv * alpha",
            "gamma = lam * dtv")


def _rotate(w: Writer) -> None:
    w.lines("cs = tl.cos(theta)", "sn = tl.sin(theta)",
            "ke = bbe * cs - bbo * sn", "ko = bbe * sn + bbo * cs",
            "qe = cbe * cs - cbo * sn", "qo = cbe * sn + cbo * cs")


def _advance(w: Writer) -> None:
    """theta_t and k_t, q_t, then S_t from S_{t-1}."""
    w.lines("theta = theta + PI * tang * dtv", "theta = theta - TWO_PI * tl.floor(theta / TWO_PI)")
    _rotate(w)
    for hf in "eo":
        w.line(f"S{hf} = alpha[None, :] * S{hf} + xp[:, None] * (beta * kp{hf})[None, :] "
               f"+ xv[:, None] * (gamma * k{hf})[None, :]")


def headdim_block_partials(w: Writer, partials: list[tuple[str, str]]) -> None:
    """The backward splits headdim into blocks (grid axis 1); every output that sums over headdim
    gets one slice per block (summed by the launcher): offset each such pointer to its slice.
    Per-head gradients that enter once (final angle, final key) are read by block 0 only."""
    w.lines("pb = tl.program_id(1)", "first = offs_i * 0 + pb == 0", "pb64 = pb.to(tl.int64)",
            "lp = tl.arange(0, BP)  # headdim offsets within the block (scratch layout)",
            "pp2 = lp[:, None] * NH + offs_i[None, :]",
            "scr_ptr += (pid * tl.num_programs(1) + pb).to(tl.int64) * T * SZ")
    for ptr, size in partials:
        w.line(f"{ptr} += pb64 * {size}")


def _consts(w: Writer) -> None:
    w.lines("PI = 3.141592653589793", "TWO_PI = 6.283185307179586")


def render_forward(r: Mamba3SisoRegion, *, with_out: bool = True, checkpoints: bool = False) -> str:
    w = Writer()
    header(w, FWD, r, "Sequential Mamba-3 SISO scan, state in fp32 registers as even/odd column halves"
           + ("; stores chunk checkpoints" if checkpoints else "") + ".", tanh=True)
    args = _inputs(r) + _inits(r) + (["y_ptr", "fa_ptr", "fs_ptr", "fk_ptr", "fv_ptr"] if with_out else [])
    args += (["cS_ptr", "cth_ptr", "ck_ptr", "cx_ptr"] if checkpoints else [])
    w.line("@triton.jit")
    with w.block(f"def {FWD}({', '.join(args + SIZES + CONSTS)}):"):
        _consts(w)
        _prologue(w, r, p_block=True)
        _init_state(w, r)
        w.line("first = offs_i * 0 + tl.program_id(1) == 0  # one headdim block writes the per-head outputs")
        with w.block("for c in range(0, NC):"):
            if checkpoints:
                w.lines("ci = hb * NC + c",
                        "tl.store(cS_ptr + ci * P * N + offs_p[:, None] * N + ne[None, :], Se, mask=me2)",
                        "tl.store(cS_ptr + ci * P * N + offs_p[:, None] * N + no[None, :], So, mask=mo2)",
                        "tl.store(cth_ptr + ci * NH + offs_i, theta)",
                        "tl.store(ck_ptr + ci * N + ne, kpe, mask=m_e)",
                        "tl.store(ck_ptr + ci * N + no, kpo, mask=m_o)",
                        "tl.store(cx_ptr + ci * P + offs_p, xp, mask=m_p)")
            with w.block("for i in range(0, T):"):
                w.line("t = c * T + i")
                _step_inputs(w, r)
                _advance(w)
                if with_out:
                    w.line("y = tl.sum(Se * qe[None, :], axis=1) + tl.sum(So * qo[None, :], axis=1)")
                    if r.has_D:
                        w.line("y = y + Dv * xv")
                    if r.has_z:
                        w.line("zv = tl.load(z_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
                        silu_gate(w, "zv", grad=False)
                        w.line("y = y * silu")
                    w.line(f"tl.store(y_ptr + sidx * P + offs_p, {to_out(r, 'y_ptr', 'y')}, mask=tp)")
                    w.line("last = (offs_i * 0 + t == L - 1) & first")
                    w.lines("tl.store(fk_ptr + hb * N + ne, ke, mask=m_e & last)",
                            "tl.store(fk_ptr + hb * N + no, ko, mask=m_o & last)")
                w.lines("xp = xv", "kpe = ke", "kpo = ko")
        if with_out:
            w.lines("tl.store(fs_ptr + hb * P * N + offs_p[:, None] * N + ne[None, :], Se, mask=me2)",
                    "tl.store(fs_ptr + hb * P * N + offs_p[:, None] * N + no[None, :], So, mask=mo2)",
                    "tl.store(fa_ptr + hb * S + offs_i, theta, mask=m_a & first)")
            w.comment("the last value: x at step L-1 (padded steps load zeros, so read it again)")
            w.line("xl = tl.load(x_ptr + ((bi * L + L - 1) * H + hi) * P + offs_p, mask=m_p, other=0.0)")
            w.line("tl.store(fv_ptr + hb * P + offs_p, xl.to(tl.float32), mask=m_p)")
    return w.source()


def render_backward(r: Mamba3SisoRegion) -> str:
    w = Writer()
    header(w, BWD, r, "Reverse-chunk adjoint of the Mamba-3 SISO scan; states recomputed per chunk "
                      "from checkpoints into scratch.", tanh=True)
    args = _inputs(r) + ["cS_ptr", "cth_ptr", "ck_ptr", "cx_ptr", "scr_ptr", "gy_ptr", "ga_ptr", "gs_ptr",
                         "gk_ptr", "gv_ptr", "dx_ptr", "dBh_ptr", "dCh_ptr", "ddt_ptr", "dadt_ptr",
                         "dtrap_ptr", "dang_ptr", "dia_ptr", "dis_ptr", "dik_ptr", "div_ptr"]
    args += [n for n, on in (("dD_ptr", r.has_D), ("dz_ptr", r.has_z)) if on]
    w.line("@triton.jit")
    with w.block(f"def {BWD}({', '.join(args + SIZES + ['NB'] + CONSTS)}):"):
        _consts(w)
        _prologue(w, r, p_block=True)
        sp = "offs_p[:, None] * N"
        w.line("SZ = 2 * BP * NH + 4 * NH + BP  # scratch floats per step")
        lh = "NB * L * H"
        headdim_block_partials(w, [("dBh_ptr", f"{lh} * N"), ("dCh_ptr", f"{lh} * N"), ("ddt_ptr", lh),
                                   ("dadt_ptr", lh), ("dtrap_ptr", lh), ("dang_ptr", f"{lh} * S"),
                                   ("dia_ptr", "NB * H * S"), ("dik_ptr", "NB * H * N")]
                               + ([("dD_ptr", "NB * H")] if r.has_D else []))
        w.lines(f"Ge = tl.load(gs_ptr + hb * P * N + {sp} + ne[None, :], mask=me2, other=0.0)",
                f"Go = tl.load(gs_ptr + hb * P * N + {sp} + no[None, :], mask=mo2, other=0.0)",
                "gth = tl.load(ga_ptr + hb * S + offs_i, mask=m_a & first, other=0.0)",
                "pke = tl.load(gk_ptr + hb * N + ne, mask=m_e & first, other=0.0)",
                "pko = tl.load(gk_ptr + hb * N + no, mask=m_o & first, other=0.0)",
                "pxv = tl.load(gv_ptr + hb * P + offs_p, mask=m_p, other=0.0)",
                "dD_acc = tl.zeros((BP,), dtype=tl.float32)")
        with w.block("for cc in range(0, NC):"):
            w.lines("c = NC - 1 - cc", "ci = hb * NC + c",
                    f"Se = tl.load(cS_ptr + ci * P * N + {sp} + ne[None, :], mask=me2, other=0.0)",
                    f"So = tl.load(cS_ptr + ci * P * N + {sp} + no[None, :], mask=mo2, other=0.0)",
                    "theta = tl.load(cth_ptr + ci * NH + offs_i)",
                    "kpe = tl.load(ck_ptr + ci * N + ne, mask=m_e, other=0.0)",
                    "kpo = tl.load(ck_ptr + ci * N + no, mask=m_o, other=0.0)",
                    "xp = tl.load(cx_ptr + ci * P + offs_p, mask=m_p, other=0.0)")
            w.comment("recompute: scratch step i = (S_e, S_o before step i, k_{t-1}, x_{t-1}, theta_t)")
            with w.block("for i in range(0, T):"):
                w.lines("t = c * T + i", "sc = scr_ptr + i * SZ")
                _step_inputs(w, r)
                w.lines("tl.store(sc + pp2, Se)", "tl.store(sc + BP * NH + pp2, So)",
                        "tl.store(sc + 2 * BP * NH + offs_i, kpe)", "tl.store(sc + 2 * BP * NH + NH + offs_i, kpo)",
                        "tl.store(sc + 2 * BP * NH + 2 * NH + lp, xp)")
                _advance(w)
                w.lines("tl.store(sc + 2 * BP * NH + 2 * NH + BP + offs_i, theta)", "xp = xv", "kpe = ke", "kpo = ko")
            w.comment("adjoint, last step first; G = dLoss/dS_t")
            with w.block("for ii in range(0, T):"):
                w.lines("i = T - 1 - ii", "t = c * T + i", "sc = scr_ptr + i * SZ")
                _step_inputs(w, r)
                w.lines("Spe = tl.load(sc + pp2)", "Spo = tl.load(sc + BP * NH + pp2)",
                        "kpe = tl.load(sc + 2 * BP * NH + offs_i)", "kpo = tl.load(sc + 2 * BP * NH + NH + offs_i)",
                        "xp = tl.load(sc + 2 * BP * NH + 2 * NH + lp)",
                        "theta = tl.load(sc + 2 * BP * NH + 2 * NH + BP + offs_i)")
                _rotate(w)
                for hf in "eo":
                    w.line(f"S{hf} = alpha[None, :] * Sp{hf} + xp[:, None] * (beta * kp{hf})[None, :] "
                           f"+ xv[:, None] * (gamma * k{hf})[None, :]")
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
                        "dbv = (bi * L + t) * H * N + hi * N",
                        "tl.store(dBh_ptr + dbv + ne, dke * cs + dko * sn, mask=m_e & tv)",
                        "tl.store(dBh_ptr + dbv + no, dko * cs - dke * sn, mask=m_o & tv)",
                        "tl.store(dCh_ptr + dbv + ne, dqe * cs + dqo * sn, mask=m_e & tv)",
                        "tl.store(dCh_ptr + dbv + no, dqo * cs - dqe * sn, mask=m_o & tv)",
                        "tl.store(dang_ptr + sidx * S + offs_i, gth * PI * (1.0 - tang * tang) * dtv, mask=m_a & tv)",
                        "dth_dt = tl.sum(gth * PI * tang)",
                        "ddt = dbeta * (1.0 - lam) * alpha + dgamma * lam + dth_dt",
                        "dlam = (dgamma - dbeta * alpha) * dtv",
                        "tl.store(ddt_ptr + sidx + offs_i * 0, ddt, mask=lane0 & tv)",
                        "tl.store(dadt_ptr + sidx + offs_i * 0, alpha * dalpha + beta * dbeta, mask=lane0 & tv)",
                        "tl.store(dtrap_ptr + sidx + offs_i * 0, dlam * lam * (1.0 - lam), mask=lane0 & tv)",
                        "tl.store(dx_ptr + sidx * P + offs_p, dxv, mask=tp)")
        w.lines(f"tl.store(dis_ptr + hb * P * N + {sp} + ne[None, :], Ge, mask=me2)",
                f"tl.store(dis_ptr + hb * P * N + {sp} + no[None, :], Go, mask=mo2)",
                "tl.store(dia_ptr + hb * S + offs_i, gth, mask=m_a)",
                "tl.store(dik_ptr + hb * N + ne, pke, mask=m_e)", "tl.store(dik_ptr + hb * N + no, pko, mask=m_o)",
                "tl.store(div_ptr + hb * P + offs_p, pxv, mask=m_p)")
        if r.has_D:
            w.line("tl.store(dD_ptr + hb + offs_i * 0, tl.sum(dD_acc) + offs_i * 0.0, mask=lane0)")
    return w.source()
