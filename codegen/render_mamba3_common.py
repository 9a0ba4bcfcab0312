"""Pieces shared by the Mamba-3 scan renderers, SISO (``render_mamba3``) and MIMO
(``render_mamba3_mimo``): program setup, the carried state, per-step loads, the gradient buffers'
layout, and the frame of the forward kernel, which each variant fills with its own lanes, step,
outputs and checkpoint layout.

Both keep the (BP, dstate) state as two halves ``Se``/``So`` of NH columns and carry one key per
rank between steps.  A key is described by a ``Key``: the suffix of its variables (SISO: ``""``,
so ``ke``/``ko``; MIMO: the rank index, so ``ke0``/``ko0``), its offset in a (batch, [rank,] heads,
dstate) state and its offset in a per-chunk checkpoint.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import NamedTuple

from mambac.codegen.render_scan_common import header
from mambac.codegen.scan_ir import Mamba3Region
from mambac.codegen.writer import Writer

CONSTS = ["BP: tl.constexpr", "NH: tl.constexpr", "T: tl.constexpr"]
SP = "offs_p[:, None] * N"  # headdim rows of a (headdim, dstate) state
# gradient buffers of the backward, after the inputs, checkpoints and scratch
GRADS = ["gy_ptr", "ga_ptr", "gs_ptr", "gk_ptr", "gv_ptr", "dx_ptr", "dBh_ptr", "dCh_ptr", "ddt_ptr", "dadt_ptr",
         "dtrap_ptr", "dang_ptr", "dia_ptr", "dis_ptr", "dik_ptr", "div_ptr"]
CHECKPOINTS = ["cS_ptr", "cth_ptr", "ck_ptr", "cx_ptr"]


class Key(NamedTuple):
    suffix: str  # of the key's variables
    state: str   # offset of the key in a (batch, [rank,] heads, dstate) state
    ckpt: str    # offset of the key in the chunk checkpoint ``ci``


def consts(w: Writer) -> None:
    w.lines("PI = 3.141592653589793", "TWO_PI = 6.283185307179586")


def inits(r: Mamba3Region) -> list[str]:
    """Arguments of the incoming state parts the region has."""
    return [n for n, on in (("ia_ptr", r.init_angle), ("is_ptr", r.init_ssm), ("ik_ptr", r.init_k),
                            ("iv_ptr", r.init_v)) if on]


def load_key(w: Writer, var: str, ptr: str, off: str, k: Key, mask: str = "", cast: bool = False) -> None:
    """``{var}e{k}``, ``{var}o{k}`` from the key at ``off`` of ``ptr`` (``mask`` and-ed to the lanes')."""
    for hf in "eo":
        w.line(f"{var}{hf}{k.suffix} = tl.load({ptr} + {off} + n{hf}, mask=m_{hf}{mask}, other=0.0)"
               + (".to(tl.float32)" if cast else ""))


def store_key(w: Writer, ptr: str, off: str, var: str, k: Key, mask: str = "") -> None:
    """Store ``{var}e{k}``, ``{var}o{k}`` as the key at ``off`` of ``ptr``."""
    for hf in "eo":
        w.line(f"tl.store({ptr} + {off} + n{hf}, {var}{hf}{k.suffix}, mask=m_{hf}{mask})")


def init_state(w: Writer, r: Mamba3Region, keys: list[Key]) -> None:
    """State, angle, previous keys and previous x before step 0: given, or zeros."""
    for hf in "eo":
        w.line(f"S{hf} = " + (f"tl.load(is_ptr + hb * P * N + {SP} + n{hf}[None, :], "
                              f"mask=m{hf}2, other=0.0).to(tl.float32)" if r.init_ssm
                              else "tl.zeros((BP, NH), dtype=tl.float32)"))
    w.line("theta = " + ("tl.load(ia_ptr + hb * S + offs_i, mask=m_a, other=0.0).to(tl.float32)"
                         if r.init_angle else "tl.zeros((NH,), dtype=tl.float32)"))
    for k in keys:
        if r.init_k:
            load_key(w, "kp", "ik_ptr", k.state, k, cast=True)
        else:
            w.lines(f"kpe{k.suffix} = tl.zeros((NH,), dtype=tl.float32)",
                    f"kpo{k.suffix} = tl.zeros((NH,), dtype=tl.float32)")
    w.line("xp = " + ("tl.load(iv_ptr + hb * P + offs_p, mask=m_p, other=0.0).to(tl.float32)"
                      if r.init_v else "tl.zeros((BP,), dtype=tl.float32)"))


def step_loads(w: Writer) -> None:
    """Per-step masks, scalars (dt, adt, trap as vectors of identical lanes), angles and x of step t;
    padded steps load zeros."""
    w.lines("tv = offs_i * 0 + t < L", "tp = m_p & (offs_p * 0 + t < L)", "sidx = (bi * L + t) * H + hi",
            "dtv = tl.load(dt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "adtv = tl.load(adt_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "trv = tl.load(trap_ptr + sidx + offs_i * 0, mask=tv, other=0.0).to(tl.float32)",
            "ang = tl.load(ang_ptr + sidx * S + offs_i, mask=tv & m_a, other=0.0).to(tl.float32)",
            "tang = _tanh(ang)",
            "xv = tl.load(x_ptr + sidx * P + offs_p, mask=tp, other=0.0).to(tl.float32)")


def advance_angle(w: Writer) -> None:
    """theta_t from theta_{t-1}, kept in [0, 2 pi)."""
    w.lines("theta = theta + PI * tang * dtv", "theta = theta - TWO_PI * tl.floor(theta / TWO_PI)")


def rotate(w: Writer, k: Key) -> None:
    """Key and query of step t: the biased B and C rotated by theta (``cs``, ``sn``)."""
    s = k.suffix
    w.lines(f"ke{s} = bbe * cs - bbo * sn", f"ko{s} = bbe * sn + bbo * cs",
            f"qe{s} = cbe * cs - cbo * sn", f"qo{s} = cbe * sn + cbo * cs")


def mixing(w: Writer) -> None:
    """The step's decay and the trapezoid weights of the previous and the current input."""
    w.lines("alpha = tl.exp(adtv)", "lam = tl.sigmoid(trv)", "beta = (1.0 - lam) * dtv * alpha",
            "gamma = lam * dtv")


def shift(w: Writer, keys: list[Key]) -> None:
    """The step's x and keys become the previous ones."""
    w.line("xp = xv")
    for k in keys:
        w.lines(f"kpe{k.suffix} = ke{k.suffix}", f"kpo{k.suffix} = ko{k.suffix}")


def headdim_block_partials(w: Writer, r: Mamba3Region, keys_per_step: str, keys_per_head: str) -> None:
    """The backward splits headdim into blocks (grid axis 1); every output that sums over headdim
    gets one slice per block (summed by the launcher): offset each such pointer to its slice.
    Per-head gradients that enter once (final angle, final key) are read by block 0 only.
    ``keys_per_step`` / ``keys_per_head``: the size of the keys of one step / of one head's state."""
    lh = "NB * L * H"
    partials = [("dBh_ptr", f"{lh} * {keys_per_step}"), ("dCh_ptr", f"{lh} * {keys_per_step}"), ("ddt_ptr", lh),
                ("dadt_ptr", lh), ("dtrap_ptr", lh), ("dang_ptr", f"{lh} * S"), ("dia_ptr", "NB * H * S"),
                ("dik_ptr", f"NB * {keys_per_head}")] + ([("dD_ptr", "NB * H")] if r.has_D else [])
    w.lines("pb = tl.program_id(1)", "first = offs_i * 0 + pb == 0", "pb64 = pb.to(tl.int64)",
            "lp = tl.arange(0, BP)  # headdim offsets within the block (scratch layout)",
            "pp2 = lp[:, None] * NH + offs_i[None, :]",
            "scr_ptr += (pid * tl.num_programs(1) + pb).to(tl.int64) * T * SZ")
    for ptr, size in partials:
        w.line(f"{ptr} += pb64 * {size}")


def load_state_grads(w: Writer) -> None:
    """Gradients of the final state and angle (the latter read by headdim block 0 only)."""
    w.lines(f"Ge = tl.load(gs_ptr + hb * P * N + {SP} + ne[None, :], mask=me2, other=0.0)",
            f"Go = tl.load(gs_ptr + hb * P * N + {SP} + no[None, :], mask=mo2, other=0.0)",
            "gth = tl.load(ga_ptr + hb * S + offs_i, mask=m_a & first, other=0.0)")


def load_checkpoint(w: Writer) -> None:
    """Chunk ``c`` (last first) and its checkpointed state and angle."""
    w.lines("c = NC - 1 - cc", "ci = hb * NC + c",
            f"Se = tl.load(cS_ptr + ci * P * N + {SP} + ne[None, :], mask=me2, other=0.0)",
            f"So = tl.load(cS_ptr + ci * P * N + {SP} + no[None, :], mask=mo2, other=0.0)",
            "theta = tl.load(cth_ptr + ci * NH + offs_i)")


def store_bc_grads(w: Writer, off: str, k: Key) -> None:
    """Gradients of the biased B_t and C_t at ``off`` (step t, head, rank), from those of key ``dke``,
    ``dko`` and query ``dqe{k}``, ``dqo{k}``: the rotation applied backwards."""
    q = k.suffix
    w.lines(f"tl.store(dBh_ptr + {off} + ne, dke * cs + dko * sn, mask=m_e & tv)",
            f"tl.store(dBh_ptr + {off} + no, dko * cs - dke * sn, mask=m_o & tv)",
            f"tl.store(dCh_ptr + {off} + ne, dqe{q} * cs + dqo{q} * sn, mask=m_e & tv)",
            f"tl.store(dCh_ptr + {off} + no, dqo{q} * cs - dqe{q} * sn, mask=m_o & tv)")


def store_step_grads(w: Writer) -> None:
    """Gradients of step t's scalars (from ``ddt``, ``dgamma``, ``dbeta``, ``dalpha``) and x."""
    w.lines("dlam = (dgamma - dbeta * alpha) * dtv",
            "tl.store(ddt_ptr + sidx + offs_i * 0, ddt, mask=lane0 & tv)",
            "tl.store(dadt_ptr + sidx + offs_i * 0, alpha * dalpha + beta * dbeta, mask=lane0 & tv)",
            "tl.store(dtrap_ptr + sidx + offs_i * 0, dlam * lam * (1.0 - lam), mask=lane0 & tv)",
            "tl.store(dx_ptr + sidx * P + offs_p, dxv, mask=tp)")


def store_initial_grads(w: Writer) -> None:
    """Gradients of the incoming state and angle."""
    w.lines(f"tl.store(dis_ptr + hb * P * N + {SP} + ne[None, :], Ge, mask=me2)",
            f"tl.store(dis_ptr + hb * P * N + {SP} + no[None, :], Go, mask=mo2)",
            "tl.store(dia_ptr + hb * S + offs_i, gth, mask=m_a)")


def store_dD(w: Writer, r: Mamba3Region) -> None:
    if r.has_D:
        w.line("tl.store(dD_ptr + hb + offs_i * 0, tl.sum(dD_acc) + offs_i * 0.0, mask=lane0)")


class Mamba3Source(ABC):
    """The kernel sources of one Mamba-3 region.  The frame of each kernel is here; a subclass
    gives the variant's names, arguments, keys and the steps that differ."""

    FWD: str
    BWD: str
    SIZES: list[str]
    NOTE_LAST_X = False  # comment why the forward reads x at step L-1 again

    def __init__(self, r: Mamba3Region):
        self.r = r

    @abstractmethod
    def inputs(self) -> list[str]:
        """Input arguments the region has, in launch order."""

    @abstractmethod
    def keys(self) -> list[Key]:
        """The keys carried between steps."""

    @abstractmethod
    def lanes(self, w: Writer) -> None:
        """Lane offsets and masks of the state halves, and the per-head parameters."""

    @abstractmethod
    def describe_forward(self) -> str:
        """The forward kernel's description (before any checkpoint note)."""

    @abstractmethod
    def store_checkpoint_keys(self, w: Writer) -> None:
        """The previous keys and x into chunk checkpoint ``ci``."""

    @abstractmethod
    def forward_step(self, w: Writer) -> None:
        """Loads of step t, its keys and queries, and S_t from S_{t-1}."""

    @abstractmethod
    def outputs(self, w: Writer) -> None:
        """y of step t from S_t."""

    def prologue(self, w: Writer, p_block: bool) -> None:
        """Program ids, lanes, per-head parameters."""
        w.lines("pid = tl.program_id(0)", "bi = (pid // H).to(tl.int64)", "hi = pid % H", "gi = hi // HPG")
        w.line("offs_p = tl.program_id(1) * BP + tl.arange(0, BP)" if p_block else "offs_p = tl.arange(0, BP)")
        self.lanes(w)
        if self.r.has_D:
            w.line("Dv = tl.load(D_ptr + hi).to(tl.float32)")

    def backward_signature(self, w: Writer, what: str, grads: list[str]) -> AbstractContextManager[None]:
        """Header and signature of the backward kernel (``grads``: the variant's extra outputs);
        the returned block is the kernel's body."""
        header(w, self.BWD, self.r, what, tanh=True)
        args = self.inputs() + CHECKPOINTS + ["scr_ptr"] + GRADS + grads
        w.line("@triton.jit")
        return w.block(f"def {self.BWD}({', '.join(args + self.SIZES + ['NB'] + CONSTS)}):")

    def render_forward(self, with_out: bool, checkpoints: bool) -> str:
        r, w = self.r, Writer()
        header(w, self.FWD, r, self.describe_forward() + ("; stores chunk checkpoints" if checkpoints else "")
               + ".", tanh=True)
        args = self.inputs() + inits(r) + (["y_ptr", "fa_ptr", "fs_ptr", "fk_ptr", "fv_ptr"] if with_out else [])
        args += (CHECKPOINTS if checkpoints else [])
        w.line("@triton.jit")
        with w.block(f"def {self.FWD}({', '.join(args + self.SIZES + CONSTS)}):"):
            consts(w)
            self.prologue(w, p_block=True)
            init_state(w, r, self.keys())
            w.line("first = offs_i * 0 + tl.program_id(1) == 0  # one headdim block writes the per-head outputs")
            with w.block("for c in range(0, NC):"):
                if checkpoints:
                    w.lines("ci = hb * NC + c",
                            f"tl.store(cS_ptr + ci * P * N + {SP} + ne[None, :], Se, mask=me2)",
                            f"tl.store(cS_ptr + ci * P * N + {SP} + no[None, :], So, mask=mo2)",
                            "tl.store(cth_ptr + ci * NH + offs_i, theta)")
                    self.store_checkpoint_keys(w)
                with w.block("for i in range(0, T):"):
                    w.line("t = c * T + i")
                    self.forward_step(w)
                    if with_out:
                        self.outputs(w)
                        w.line("last = (offs_i * 0 + t == L - 1) & first")
                        for k in self.keys():
                            store_key(w, "fk_ptr", k.state, "k", k, " & last")
                    shift(w, self.keys())
            if with_out:
                w.lines(f"tl.store(fs_ptr + hb * P * N + {SP} + ne[None, :], Se, mask=me2)",
                        f"tl.store(fs_ptr + hb * P * N + {SP} + no[None, :], So, mask=mo2)",
                        "tl.store(fa_ptr + hb * S + offs_i, theta, mask=m_a & first)")
                if self.NOTE_LAST_X:
                    w.comment("the last value: x at step L-1 (padded steps load zeros, so read it again)")
                w.line("xl = tl.load(x_ptr + ((bi * L + L - 1) * H + hi) * P + offs_p, mask=m_p, other=0.0)")
                w.line("tl.store(fv_ptr + hb * P + offs_p, xl.to(tl.float32), mask=m_p)")
        return w.source()
