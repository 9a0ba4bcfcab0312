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

from mambac.codegen.render_mamba3 import _consts, headdim_block_partials
from mambac.codegen.render_scan_common import header, to_out
from mambac.codegen.scan_ir import Mamba3MimoRegion
from mambac.codegen.writer import Writer

FWD = "mamba3_mimo_fwd"
BWD = "mamba3_mimo_bwd"
SIZES = ["L", "H", "G", "HPG", "P", "N", "N2", "S", "NC"]
CONSTS = ["BP: tl.constexpr", "NH: tl.constexpr", "T: tl.constexpr"]


def _inputs(r: Mamba3MimoRegion) -> list[str]:
    out = ["x_ptr", "B_ptr", "C_ptr", "dt_ptr", "adt_ptr", "trap_ptr", "ang_ptr", "ux_ptr"]
    return out + [n for n, on in (("Bb_ptr", r.has_B_bias), ("Cb_ptr", r.has_C_bias), ("uz_ptr", r.has_z),
                                  ("uo_ptr", r.has_mimo_o), ("D_ptr", r.has_D), ("z_ptr", r.has_z)) if on]


def _inits(r: Mamba3MimoRegion) -> list[str]:
    return [n for n, on in (("ia_ptr", r.init_angle), ("is_ptr", r.init_ssm), ("ik_ptr", r.init_k),
                            ("iv_ptr", r.init_v)) if on]


def _prologue(w: Writer, r: Mamba3MimoRegion, p_block: bool) -> None:
    w.lines("pid = tl.program_id(0)", "bi = (pid // H).to(tl.int64)", "hi = pid % H", "gi = hi // HPG")
    w.line("offs_p = tl.program_id(1) * BP + tl.arange(0, BP)" if p_block else "offs_p = tl.arange(0, BP)")
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
    if r.has_D:
        w.line("Dv = tl.load(D_ptr + hi).to(tl.float32)")


def _kidx(r: Mamba3MimoRegion, k: int) -> str:
    """Offset of rank k's key in a (batch, rank, heads, dstate) state."""
    return f"((bi * {r.rank} + {k}) * H + hi) * N"


def _init_state(w: Writer, r: Mamba3MimoRegion) -> None:
    for hf in "eo":
        w.line(f"S{hf} = " + (f"tl.load(is_ptr + hb * P * N + offs_p[:, None] * N + n{hf}[None, :], "
                              f"mask=m{hf}2, other=0.0).to(tl.float32)" if r.init_ssm
                              else "tl.zeros((BP, NH), dtype=tl.float32)"))
    w.line("theta = " + ("tl.load(ia_ptr + hb * S + offs_i, mask=m_a, other=0.0).to(tl.float32)"
                         if r.init_angle else "tl.zeros((NH,), dtype=tl.float32)"))
    for k in range(r.rank):
        for hf in "eo":
            w.line(f"kp{hf}{k} = " + (f"tl.load(ik_ptr + {_kidx(r, k)} + n{hf}, mask=m_{hf}, other=0.0)"
                                      f".to(tl.float32)" if r.init_k else "tl.zeros((NH,), dtype=tl.float32)"))
    w.line("xp = " + ("tl.load(iv_ptr + hb * P + offs_p, mask=m_p, other=0.0).to(tl.float32)"
                      if r.init_v else "tl.zeros((BP,), dtype=tl.float32)"))


def _step(w: Writer, r: Mamba3MimoRegion, advance: bool) -> None:
    """Loads of step t, theta_t (advanced from theta_{t-1} when ``advance``), rotated keys and
    queries of every rank, the step's decay/mixing scalars."""
    w.lines("tv = offs_i * 0 + t < L", "tp = m_p & (offs_p * 0 + t < L)", "sidx = (bi * L + t) * H + hi",
            "dtv = tl.load(dt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "adtv = tl.load(adt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "trv = tl.load(trap_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "ang = tl.load(ang_ptr + sidx * S + offs_i, mask=tv & m_a, other=0.0).to(tl.float32)",
            "tang = _tanh(ang)",
            "xv = tl.load(x_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")
    if advance:
        w.lines("theta = theta + PI * tang * dtv", "theta = theta - TWO_PI * tl.floor(theta / TWO_PI)")
    w.lines("cs = tl.cos(theta)", "sn = tl.sin(theta)")
    for k in range(r.rank):
        w.line(f"bidx = (((bi * L + t) * {r.rank} + {k}) * G + gi) * N")
        for M, bias, on in (("B", "Bb", r.has_B_bias), ("C", "Cb", r.has_C_bias)):
            for hf in "eo":
                w.line(f"{M.lower()}b{hf} = tl.load({M}_ptr + bidx + n{hf}, mask=m_{hf} & tv, other=0.0)"
                       f".to(tl.float32)" + (f" + {bias}{hf}{k}" if on else ""))
        w.lines(f"ke{k} = bbe * cs - bbo * sn", f"ko{k} = bbe * sn + bbo * cs",
                f"qe{k} = cbe * cs - cbo * sn", f"qo{k} = cbe * sn + cbo * cs")
    w.lines("alpha = tl.exp(adtv)", "lam = tl.sigmoid(trv)", "beta = (1.0 - lam) * dtv * alpha",
            "gamma = lam * dtv")


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


def _shift(w: Writer, r: Mamba3MimoRegion) -> None:
    w.line("xp = xv")
    for k in range(r.rank):
        w.lines(f"kpe{k} = ke{k}", f"kpo{k} = ko{k}")


def render_forward(r: Mamba3MimoRegion, *, with_out: bool = True, checkpoints: bool = False) -> str:
    w = Writer()
    header(w, FWD, r, f"Sequential Mamba-3 MIMO scan of rank {r.rank}, state in fp32 registers"
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
                        "tl.store(cx_ptr + ci * P + offs_p, xp, mask=m_p)")
                for k in range(r.rank):
                    for hf in "eo":
                        w.line(f"tl.store(ck_ptr + (ci * {r.rank} + {k}) * N + n{hf}, kp{hf}{k}, mask=m_{hf})")
            with w.block("for i in range(0, T):"):
                w.line("t = c * T + i")
                _step(w, r, advance=True)
                _update(w, r, "S")
                if with_out:
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
                    w.line("last = (offs_i * 0 + t == L - 1) & first")
                    for k in range(r.rank):
                        for hf in "eo":
                            w.line(f"tl.store(fk_ptr + {_kidx(r, k)} + n{hf}, k{hf}{k}, mask=m_{hf} & last)")
                _shift(w, r)
        if with_out:
            w.lines("tl.store(fs_ptr + hb * P * N + offs_p[:, None] * N + ne[None, :], Se, mask=me2)",
                    "tl.store(fs_ptr + hb * P * N + offs_p[:, None] * N + no[None, :], So, mask=mo2)",
                    "tl.store(fa_ptr + hb * S + offs_i, theta, mask=m_a & first)",
                    "xl = tl.load(x_ptr + ((bi * L + L - 1) * H + hi) * P + offs_p, mask=m_p, other=0.0)",
                    "tl.store(fv_ptr + hb * P + offs_p, xl.to(tl.float32), mask=m_p)")
    return w.source()


def render_backward(r: Mamba3MimoRegion) -> str:
    w = Writer()
    R_ = r.rank
    header(w, BWD, r, f"Reverse-chunk adjoint of the Mamba-3 MIMO scan of rank {R_}; states recomputed "
                      "per chunk from checkpoints into scratch.", tanh=True)
    args = _inputs(r) + ["cS_ptr", "cth_ptr", "ck_ptr", "cx_ptr", "scr_ptr", "gy_ptr", "ga_ptr", "gs_ptr",
                         "gk_ptr", "gv_ptr", "dx_ptr", "dBh_ptr", "dCh_ptr", "ddt_ptr", "dadt_ptr",
                         "dtrap_ptr", "dang_ptr", "dia_ptr", "dis_ptr", "dik_ptr", "div_ptr", "dux_ptr"]
    args += [n for n, on in (("duz_ptr", r.has_z), ("duo_ptr", r.has_mimo_o), ("dD_ptr", r.has_D),
                             ("dz_ptr", r.has_z)) if on]
    w.line("@triton.jit")
    with w.block(f"def {BWD}({', '.join(args + SIZES + ['NB'] + CONSTS)}):"):
        _consts(w)
        _prologue(w, r, p_block=True)
        sp = "offs_p[:, None] * N"
        w.line(f"SZ = 2 * BP * NH + {2 * R_} * NH + BP + NH  # scratch floats per step")
        lh = "NB * L * H"
        headdim_block_partials(w, [("dBh_ptr", f"{lh} * {R_} * N"), ("dCh_ptr", f"{lh} * {R_} * N"),
                                   ("ddt_ptr", lh), ("dadt_ptr", lh), ("dtrap_ptr", lh), ("dang_ptr", f"{lh} * S"),
                                   ("dia_ptr", "NB * H * S"), ("dik_ptr", f"NB * {R_} * H * N")]
                               + ([("dD_ptr", "NB * H")] if r.has_D else []))
        w.lines(f"Ge = tl.load(gs_ptr + hb * P * N + {sp} + ne[None, :], mask=me2, other=0.0)",
                f"Go = tl.load(gs_ptr + hb * P * N + {sp} + no[None, :], mask=mo2, other=0.0)",
                "gth = tl.load(ga_ptr + hb * S + offs_i, mask=m_a & first, other=0.0)",
                "pxv = tl.load(gv_ptr + hb * P + offs_p, mask=m_p, other=0.0)",
                "dD_acc = tl.zeros((BP,), dtype=tl.float32)")
        for k in range(R_):
            for hf in "eo":
                w.line(f"pk{hf}{k} = tl.load(gk_ptr + {_kidx(r, k)} + n{hf}, mask=m_{hf} & first, other=0.0)")
            w.line(f"dux{k} = tl.zeros((BP,), dtype=tl.float32)")
            if r.has_z:
                w.line(f"duz{k} = tl.zeros((BP,), dtype=tl.float32)")
            if r.has_mimo_o:
                w.line(f"duo{k} = tl.zeros((BP,), dtype=tl.float32)")
        with w.block("for cc in range(0, NC):"):
            w.lines("c = NC - 1 - cc", "ci = hb * NC + c",
                    f"Se = tl.load(cS_ptr + ci * P * N + {sp} + ne[None, :], mask=me2, other=0.0)",
                    f"So = tl.load(cS_ptr + ci * P * N + {sp} + no[None, :], mask=mo2, other=0.0)",
                    "theta = tl.load(cth_ptr + ci * NH + offs_i)",
                    "xp = tl.load(cx_ptr + ci * P + offs_p, mask=m_p, other=0.0)")
            for k in range(R_):
                for hf in "eo":
                    w.line(f"kp{hf}{k} = tl.load(ck_ptr + (ci * {R_} + {k}) * N + n{hf}, mask=m_{hf}, other=0.0)")
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
                _shift(w, r)
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
        _final_stores(w, r, sp)
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
    for k in range(R_):
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
                f"kb = dbv + ({k} * H + hi) * N",
                "tl.store(dBh_ptr + kb + ne, dke * cs + dko * sn, mask=m_e & tv)",
                "tl.store(dBh_ptr + kb + no, dko * cs - dke * sn, mask=m_o & tv)",
                f"tl.store(dCh_ptr + kb + ne, dqe{k} * cs + dqo{k} * sn, mask=m_e & tv)",
                f"tl.store(dCh_ptr + kb + no, dqo{k} * cs - dqe{k} * sn, mask=m_o & tv)")
    w.lines("pxv = tl.where(tp, pxn, pxv)", "Ge = alpha[None, :] * Ge", "Go = alpha[None, :] * Go",
            "gth += tl.where(m_a, dth, 0.0)",
            "tl.store(dang_ptr + sidx * S + offs_i, gth * PI * (1.0 - tang * tang) * dtv, mask=m_a & tv)",
            "ddt = dbeta * (1.0 - lam) * alpha + dgamma * lam + tl.sum(gth * PI * tang)",
            "dlam = (dgamma - dbeta * alpha) * dtv",
            "tl.store(ddt_ptr + sidx + offs_i * 0, ddt, mask=lane0 & tv)",
            "tl.store(dadt_ptr + sidx + offs_i * 0, alpha * dalpha + beta * dbeta, mask=lane0 & tv)",
            "tl.store(dtrap_ptr + sidx + offs_i * 0, dlam * lam * (1.0 - lam), mask=lane0 & tv)",
            "tl.store(dx_ptr + sidx * P + offs_p, dxv, mask=tp)")


def _final_stores(w: Writer, r: Mamba3MimoRegion, sp: str) -> None:
    w.lines(f"tl.store(dis_ptr + hb * P * N + {sp} + ne[None, :], Ge, mask=me2)",
            f"tl.store(dis_ptr + hb * P * N + {sp} + no[None, :], Go, mask=mo2)",
            "tl.store(dia_ptr + hb * S + offs_i, gth, mask=m_a)",
            "tl.store(div_ptr + hb * P + offs_p, pxv, mask=m_p)")
    for k in range(r.rank):
        w.lines(f"tl.store(dik_ptr + {_kidx(r, k)} + ne, pke{k}, mask=m_e)",
                f"tl.store(dik_ptr + {_kidx(r, k)} + no, pko{k}, mask=m_o)")
        for name, on in (("dux", True), ("duz", r.has_z), ("duo", r.has_mimo_o)):
            if on:
                w.line(f"tl.store({name}_ptr + (hb * {r.rank} + {k}) * P + offs_p, {name}{k}, mask=m_p)")
    if r.has_D:
        w.line("tl.store(dD_ptr + hb + offs_i * 0, tl.sum(dD_acc) + offs_i * 0.0, mask=lane0)")
