"""Ahead-of-time compile of every Triton kernel pyrl launches, for real CUDA GPUs, on any machine.

No GPU is needed: Triton compiles to PTX itself and ships ptxas (and cuobjdump), so each kernel goes all
the way to a cubin for sm_80 (A100) and sm_90 (H100), and ptxas reports its registers and spills.

The variants are not listed by hand. The public ops (pyrl.ops) are driven with the backend forced to
Triton on small CPU tensors, over the ops' own tables (FLOAT_KIND, KL_KINDS, POLICY_LOSS_MODES,
GROUP_ESTIMATORS, ...) and a range of realistic shapes, with every kernel in pyrl.kernels swapped for a
recorder: each launch is recorded instead of run, with the arguments the launcher really passes (dtypes
after the ops' conversions, constexprs such as BLOCK picked by the launcher's own rule, num_warps). Each
launch is then specialized by Triton's JIT binder exactly as a launch on a GPU would be (pointer dtypes,
16-byte alignment, int32/int64 and divisibility by 16 of integer arguments, constexpr values), and
identical specializations are compiled once. A kernel added to pyrl.kernels that no scenario here
launches is reported by `unlaunched_kernels()` (and fails tests/ops/test_triton_compile.py).

    python -m pyrl.ops.compile_report            # markdown table (fresh Triton cache: true compile times)

Compiling needs a process in which triton.language was imported without TRITON_INTERPRET=1 (see
compiles_here); where it was (the tests on CPU machines), compile_all runs the compiles in a child process.

Written against Triton 3.9's JIT internals (the binder and JITFunction._pack_args, which turn launch
arguments into a signature, constexprs and attributes); another Triton may need this adapted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from pyrl import ops
from pyrl.models.tiny import TinyModelSpec
from pyrl.ops.codes import FLOAT_KIND

TARGETS = (80, 90)  # CUDA compute capabilities: sm_80 (A100), sm_90 (H100; Triton emits sm_90a)

# Token-level shapes [batch, tokens]: one whose sizes are multiples of 16 and one whose are not. The JIT
# specializes integer arguments (numel, sequence lengths) on divisibility by 16, so both give binaries.
TOKEN_SHAPES = ((8, 1024), (3, 777))


def vocab_sizes() -> dict[str, int]:
    """Vocabularies the log-prob kernels see. Their BLOCK is min(4096, next_pow2(vocab)) (the launcher's
    rule), so every real LM gives 4096 and pyrl's tiny test model a small block; 50257 is a vocabulary (and
    row stride) that is not a multiple of 16."""
    return {
        "pyrl tiny model": TinyModelSpec.vocab_size,
        "Llama-2": 32000,
        "GPT-2": 50257,
        "Llama-3": 128256,
        "Qwen2.5": 151936,
    }


# ---------------------------------------------------------------------------------------------- kernels


def _kernel_types():
    # lazy: triton is optional
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


def kernel_modules() -> list:
    import pyrl.kernels  # lazy: triton is optional (pyrl.kernels imports it)

    return [importlib.import_module(f"pyrl.kernels.{m.name}") for m in pkgutil.iter_modules(pyrl.kernels.__path__)]


def kernels() -> dict[str, object]:
    """{"module.kernel": the @triton.jit object} for every kernel defined in pyrl.kernels (a JITFunction,
    or an InterpretedFunction when TRITON_INTERPRET=1 was set at import). Kernels are the @triton.jit functions
    named *_kernel; the others (gae._compose) are device functions, compiled inside the kernels that call them."""
    found = {}
    for module in kernel_modules():
        for name, obj in vars(module).items():
            if (isinstance(obj, _kernel_types()) and getattr(obj.fn, "__module__", None) == module.__name__
                    and name.endswith("_kernel")):
                found[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = obj
    return found


@functools.lru_cache(maxsize=None)
def _jit(qualname: str):
    """A compilable JITFunction for the kernel (rebuilt from the Python function under the interpreter)."""
    JITFunction, _ = _kernel_types()
    kernel = kernels()[qualname]
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


@functools.lru_cache(maxsize=None)
def _backend(capability: int):
    # lazy: triton is optional
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    return target, make_backend(target)


# ---------------------------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One specialization of one kernel, as the JIT would compile it: signature {param: type}, constexprs
    {(index,): value}, attrs {(index,): [["tt.divisibility", 16]]} and the launch options (num_warps...)."""

    kernel: str
    signature: tuple
    constexprs: tuple
    attrs: tuple
    options: tuple

    @property
    def label(self) -> str:
        """Constexprs, pointers that are not fp32 (their dtype), num_warps, int64 scalars, pointers not
        16-byte aligned, and which integer arguments are multiples of 16 (the JIT specializes on both)."""
        names = [name for name, _ in self.signature]
        parts = [f"{names[path[0]]}={_short(value)}" for path, value in self.constexprs]
        parts += [f"{name.removesuffix('_ptr')}:{ty[1:]}" for name, ty in self.signature
                  if ty.startswith("*") and ty != "*fp32"]
        parts += [f"warps={v}" for k, v in self.options if k == "num_warps"]
        divisible = {path[0] for path, attr in self.attrs if attr}
        ints = [(i, name) for i, (name, ty) in enumerate(self.signature) if ty[0] in "iu"]
        parts += [f"{name}:{ty}" for name, ty in self.signature if ty == "i64"]
        parts += [f"unaligned:{name}" for i, (name, ty) in enumerate(self.signature)
                  if ty.startswith("*") and i not in divisible]
        if ints:
            parts.append("div16:" + (",".join(name for i, name in ints if i in divisible) or "-"))
        return " ".join(parts)


def _short(value):
    return int(value) if isinstance(value, bool) else value


def _hashable(x):
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    return x


def _specialize(qualname: str, args, kwargs) -> Variant:
    """What JITFunction.run does with a launch before compiling it (Triton 3.9), for a CUDA target."""
    # lazy: triton is optional
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    jit = _jit(qualname)
    _, backend = _backend(TARGETS[0])  # the CUDA backend; its specialization does not depend on the arch
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound_args, specialization, options)
    launch_options = {k: v for k, v in kwargs.items() if k not in signature}
    return Variant(qualname, tuple(signature.items()), _hashable(constexprs), _hashable(attrs),
                   _hashable(launch_options))


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch's specialization."""

    def __init__(self, qualname: str, sink: list):
        self.qualname, self.sink = qualname, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(_specialize(self.qualname, args, kwargs))

        return launch


@contextlib.contextmanager
def _recording(sink: list):
    """The ops forced onto the Triton backend (the interpreter flag only satisfies the CPU-tensor check:
    no kernel runs) with every kernel replaced by a recorder."""
    found = kernels()
    saved_env = {k: os.environ.get(k) for k in ("PYRL_OPS_BACKEND", "TRITON_INTERPRET")}
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in kernel_modules()}
    precise = modules["swiglu"].PRECISE
    try:
        os.environ.update(PYRL_OPS_BACKEND="triton", TRITON_INTERPRET="1")
        # what a GPU launch passes (the interpreter, imported first here, has no libdevice)
        modules["swiglu"].PRECISE = True
        for qualname in found:
            _jit(qualname)  # before the swap: it looks the kernel up in its module
            module, name = qualname.split(".")
            setattr(modules[module], name, _Recorder(qualname, sink))
        yield
    finally:
        modules["swiglu"].PRECISE = precise
        for qualname, kernel in found.items():
            module, name = qualname.split(".")
            setattr(modules[module], name, kernel)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _drive_ops() -> None:
    """Every way pyrl.ops reaches a Triton kernel, over the ops' own tables and realistic shapes."""
    gen = torch.Generator().manual_seed(0)
    for dtype in FLOAT_KIND:  # log-probs and entropy: fp32/bf16/fp16 logits, each vocabulary
        for vocab in sorted(set(vocab_sizes().values())):
            labels = torch.randint(0, vocab, (2,), generator=gen)

            def logits():
                return torch.zeros(2, vocab, dtype=dtype, requires_grad=True)

            ops.logprobs_from_logits(logits(), labels).sum().backward()
            for used in ((True, True), (True, False), (False, True)):  # d logp and d entropy, alone and both
                outputs = ops.logprobs_from_logits(logits(), labels, return_entropy=True)
                sum(out.sum() for out, use in zip(outputs, used) if use).backward()
            ops.entropy_from_logits(logits()).sum().backward()
            for want_entropy in (False, True):  # the same kernels on chunks of lm_head logits
                hidden = torch.zeros(2, 8, dtype=dtype, requires_grad=True)
                weight = torch.zeros(vocab, 8, dtype=dtype, requires_grad=True)
                out = ops.fused_linear_logprobs(hidden, weight, labels, return_entropy=want_entropy)
                (out[0] + out[1] if want_entropy else out).sum().backward()

    for b, t in TOKEN_SHAPES:
        mask = torch.ones(b, t, dtype=torch.bool)
        for dtype in (torch.float32, torch.bfloat16):  # the ops convert to float32 before the kernels
            for kind in [*ops.KL_KINDS, *(k + "+" for k in ops.KL_KINDS)]:
                logp = torch.zeros(b, t, dtype=dtype, requires_grad=True)
                ops.kl_penalty(logp, torch.zeros(b, t, dtype=dtype), kind).sum().backward()
            for mode in ops.POLICY_LOSS_MODES:
                logp = torch.zeros(b, t, dtype=dtype, requires_grad=True)
                zeros = torch.zeros(b, t, dtype=dtype)
                ops.ppo_policy_loss(logp, zeros, zeros, mask, loss_mode=mode)[0].backward()
            values = torch.zeros(b, t, dtype=dtype, requires_grad=True)
            zeros = torch.zeros(b, t, dtype=dtype)
            ops.value_loss(values, zeros, zeros, mask)[0].backward()
            rewards = torch.zeros(b, t, dtype=dtype)
            # the recorder runs no kernel, so the whitening after it finds the moments empty and raises: the
            # launch is recorded by then (without whitening the kernel has no moments: both variants are wanted)
            for whiten in (True, False):
                with contextlib.suppress(ValueError):
                    ops.compute_gae(rewards, rewards, mask, gamma=0.99, lam=0.95, whiten=whiten)
            lengths = torch.full((b,), t, dtype=torch.int64)
            lengths[1:] -= torch.arange(1, b) * (t // (2 * b))  # ragged, the longest first
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
            flat = torch.zeros(int(cu[-1]), dtype=dtype)
            for packed_mask in (None, torch.ones(int(cu[-1]), dtype=torch.bool)):
                for whiten in (True, False):
                    with contextlib.suppress(ValueError):
                        ops.compute_gae_packed(flat, flat, cu, gamma=0.99, lam=0.95, mask=packed_mask, whiten=whiten)

    # the model layers' elementwise kernels (pyrl.models, with model.use_fused_kernels): the gated MLP's over
    # element counts that are (16 x 47) and are not (7 x 47) multiples of 16; RMSNorm's over the hidden widths of
    # the tiny model, Qwen3's per-head norms (128), Qwen2.5-0.5B, 7-8B and 70B models, up to the widest the kernels
    # take (MAX_TRITON_HIDDEN), with one row per program (a GPU's usual case, which the JIT specializes) and more,
    # the weight trained and frozen
    from pyrl.models.gated_mlp import gated_mlp  # lazy: pyrl.ops is imported by pyrl.models
    from pyrl.models.rms_norm import MAX_TRITON_HIDDEN, rms_norm  # lazy: as gated_mlp above

    for dtype in FLOAT_KIND:
        for tokens in (16, 7):
            x = torch.zeros(tokens, 16, dtype=dtype, requires_grad=True)
            weights = [torch.zeros(47, 16, dtype=dtype, requires_grad=True),
                       torch.zeros(47, 16, dtype=dtype, requires_grad=True),
                       torch.zeros(16, 47, dtype=dtype, requires_grad=True)]
            gated_mlp(x, *weights).sum().backward()
        for hidden in (64, 128, 896, 4096, MAX_TRITON_HIDDEN):
            for rows, trained in ((4, True), (5, True), (4, False)):  # the interpreter runs 4 programs
                x = torch.zeros(rows, hidden, dtype=dtype, requires_grad=True)
                rms_norm(x, torch.ones(hidden, dtype=dtype, requires_grad=trained), 1e-6).sum().backward()

    groups, per_group = 16, 8
    scores = torch.rand(groups * per_group, generator=gen)
    ids = torch.arange(groups).repeat_interleave(per_group)
    lengths = torch.randint(1, 512, (groups * per_group,), generator=gen)
    for estimator in ops.GROUP_ESTIMATORS:
        for norm in (True, False):
            ops.group_advantages(scores, ids, estimator, norm_by_std=norm, lengths=lengths)


@functools.lru_cache(maxsize=None)
def _recorded() -> tuple[Variant, ...]:
    sink: list[Variant] = []
    with _recording(sink):
        _drive_ops()
    return tuple(sink)


def variants() -> list[Variant]:
    """The distinct specializations pyrl launches, in first-launch order."""
    return list(dict.fromkeys(_recorded()))


def launch_count() -> int:
    return len(_recorded())


def unlaunched_kernels() -> list[str]:
    launched = {v.kernel for v in variants()}
    return [k for k in kernels() if k not in launched]


# ---------------------------------------------------------------------------------------------- compile


@dataclass(frozen=True)
class CompileRow:
    kernel: str
    variant: str
    target: str
    registers: int | None = None
    spill_stores: int | None = None  # bytes, as ptxas -v reports them
    spill_loads: int | None = None
    stack: int | None = None  # bytes of stack frame per thread
    shared: int | None = None  # bytes of shared memory per block (Triton's metadata.shared)
    num_warps: int | None = None
    seconds: float = 0.0  # Triton's compile to cubin plus the ptxas -v re-run
    error: str | None = None

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_CUOBJDUMP_REG = re.compile(r"REG:(\d+)")


def _ptxas_report(ptx: str, capability: int, options) -> tuple[int, int, int, int]:
    """(registers, stack, spill stores, spill loads) from `ptxas -v` run as Triton runs it (its ptxas for the
    arch, its flags; triton/backends/nvidia/compiler.py make_cubin)."""
    # lazy: triton is optional
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    flags = ["-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(capability)}"]
    if not options.enable_fp_fusion:
        flags.insert(1, "--fmad=false")
    if options.ptx_options:
        flags[-1:-1] = options.ptx_options.split(" ")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(capability).path, *flags, src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True).stderr
    used, frame = _PTXAS_USED.search(log), _PTXAS_FRAME.search(log)
    if used is None or frame is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    stack, stores, loads = map(int, frame.groups())
    return int(used.group(1)), stack, stores, loads


def _cubin_registers(cubin: bytes) -> int:
    """Registers of the cubin Triton built, read back with cuobjdump (a check on the ptxas re-run)."""
    # lazy: triton is optional
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return int(_CUOBJDUMP_REG.search(out).group(1))


@functools.lru_cache(maxsize=None)
def compile_variant(variant: Variant, capability: int) -> CompileRow:
    """Compile one variant to a cubin for sm_<capability>; errors come back in the row, not raised."""
    # lazy: triton is optional
    import triton
    from triton.compiler import ASTSource

    if not compiles_here():
        raise RuntimeError("triton.language was imported with TRITON_INTERPRET=1: compile in another process "
                           "(compile_all does)")
    target, backend = _backend(capability)
    options = backend.parse_options(dict(variant.options))
    row = dict(kernel=variant.kernel, variant=variant.label, target=f"sm_{capability}", num_warps=options.num_warps)
    start = time.perf_counter()
    try:
        src = ASTSource(_jit(variant.kernel), dict(variant.signature), dict(variant.constexprs),
                        {path: [list(a) for a in attr] for path, attr in variant.attrs})
        compiled = triton.compile(src, target=target, options=options.__dict__)
        registers, stack, stores, loads = _ptxas_report(compiled.asm["ptx"], capability, options)
        cubin_registers = _cubin_registers(compiled.asm["cubin"])
        if cubin_registers != registers:
            raise RuntimeError(f"ptxas -v says {registers} registers, Triton's cubin has {cubin_registers}")
    except Exception as e:  # noqa: BLE001 - a compile error is a result here
        return CompileRow(**row, seconds=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    return CompileRow(**row, registers=registers, spill_stores=stores, spill_loads=loads, stack=stack,
                      shared=compiled.metadata.shared, seconds=time.perf_counter() - start)


def compiles_here() -> bool:
    """False where triton.language was imported with TRITON_INTERPRET=1 (as the tests do on CPU machines):
    its own @jit helpers (tl.sum, tl.max, ...) are then interpreter functions, which the compiler cannot
    inline (calling one patches triton.language for the interpreter for good)."""
    # lazy: triton is optional
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(tl.sum, JITFunction)


def _selected(match: str | None) -> list[Variant]:
    return [v for v in variants() if match is None or re.search(match, f"{v.kernel} [{v.label}]")]


@functools.lru_cache(maxsize=None)
def _compile_all(targets: tuple, cache_dir: str | None, match: str | None, maxnreg: int | None) -> tuple:
    if not compiles_here():
        return _compile_in_child(targets, cache_dir, match, maxnreg)
    # lazy: triton is optional
    from triton import knobs

    found = _selected(match)
    if maxnreg is not None:
        found = [dataclasses.replace(v, options=v.options + (("maxnreg", maxnreg),)) for v in found]
    with knobs.cache.scope():
        if cache_dir is not None:
            knobs.cache.dir = cache_dir
        return tuple(compile_variant(v, cc) for v in found for cc in targets)


def _compile_in_child(targets, cache_dir, match, maxnreg) -> tuple:
    """The same compile in a fresh interpreter without TRITON_INTERPRET; rows come back as JSON."""
    cmd = [sys.executable, "-m", "pyrl.ops.compile_report", "--json", "--targets", *map(str, targets)]
    cmd += ["--cache-dir", cache_dir] if cache_dir is not None else ["--reuse-cache"]
    cmd += ["--match", match] if match is not None else []
    cmd += ["--maxnreg", str(maxnreg)] if maxnreg is not None else []
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYRL_OPS_BACKEND")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return tuple(CompileRow(**row) for row in json.loads(out.stdout))


def compile_all(targets=TARGETS, cache_dir: str | None = None, match: str | None = None,
                maxnreg: int | None = None) -> list[CompileRow]:
    """Every variant pyrl launches, compiled for each target: one row per (kernel, variant, target); compile
    errors are in the rows. cache_dir: Triton's cache (None: its default, ~/.triton/cache); match: only the
    variants whose "kernel [label]" matches this regex; maxnreg: cap the registers (spills on purpose).
    Where this process cannot compile (compiles_here), a child process does it. Cached per process."""
    return list(_compile_all(tuple(targets), cache_dir, match, maxnreg))


# ---------------------------------------------------------------------------------------------- report


def markdown(rows: list[CompileRow]) -> str:
    """One line per kernel/variant, registers / spill stores+loads / shared memory for each target."""
    targets = list(dict.fromkeys(r.target for r in rows))
    by_variant: dict[tuple[str, str], dict[str, CompileRow]] = {}
    for r in rows:
        by_variant.setdefault((r.kernel, r.variant), {})[r.target] = r
    head = ["kernel", "variant"]
    for t in targets:
        head += [f"{t} regs", f"{t} spill st/ld B", f"{t} smem B"]
    head.append("compile s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (kernel, variant), per_target in sorted(by_variant.items(), key=lambda item: item[0][0]):  # stable
        cells = [f"`{kernel}`", variant]
        for t in targets:
            r = per_target.get(t)
            if r is None:
                cells += ["", "", ""]
            elif r.error:
                cells += ["**error**", r.error.splitlines()[0][:80], ""]
            else:
                cells += [str(r.registers), f"{r.spill_stores}/{r.spill_loads}", str(r.shared)]
        cells.append(f"{sum(r.seconds for r in per_target.values()):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[CompileRow]) -> str:
    """Per kernel and target: variants, register range, worst spills, shared memory range."""
    groups: dict[tuple[str, str], list[CompileRow]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.target), []).append(r)
    lines = ["| kernel | target | variants | registers | spill st/ld B (max) | smem B | errors |",
             "|---|---|---|---|---|---|---|"]
    for (kernel, target), rs in sorted(groups.items()):
        ok = [r for r in rs if not r.error]
        regs = sorted(r.registers for r in ok) or [0]
        smem = sorted(r.shared for r in ok) or [0]
        lines.append(
            f"| `{kernel}` | {target} | {len(rs)} | {regs[0]}-{regs[-1]} | "
            f"{max((r.spill_stores for r in ok), default=0)}/{max((r.spill_loads for r in ok), default=0)} | "
            f"{smem[0]}-{smem[-1]} | {len(rs) - len(ok)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    import triton  # lazy: triton is optional

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", type=int, default=list(TARGETS), help="compute capabilities (80 90)")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--reuse-cache", action="store_true",
                       help="use Triton's cache (default: a fresh one, so that compile times are real)")
    cache.add_argument("--cache-dir", help="Triton cache directory to use")
    parser.add_argument("--match", help="only the variants whose 'kernel [variant]' matches this regex")
    parser.add_argument("--maxnreg", type=int, help="cap the registers per thread (to see spills)")
    parser.add_argument("--json", action="store_true", help="the rows as JSON (exit 0 whatever they say)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or (None if args.reuse_cache else tmp)
        rows = compile_all(tuple(args.targets), cache_dir, args.match, args.maxnreg)
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
        return 0
    print(f"triton {triton.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; {len(kernels())} kernels, {launch_count()} launches recorded, "
          f"{len(_selected(args.match))} distinct variants x {len(args.targets)} targets = {len(rows)} compiles "
          f"in {elapsed:.1f} s")
    missing = unlaunched_kernels()
    if missing:
        print(f"kernels no scenario launches: {', '.join(missing)}")
    print()
    print(summary(rows))
    print()
    print(markdown(rows))
    bad = [r for r in rows if r.error or r.spills]
    for r in bad:
        problem = r.error or f"spills {r.spill_stores}/{r.spill_loads} B"
        print(f"\nFAILED {r.kernel} [{r.variant}] {r.target}: {problem}")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
