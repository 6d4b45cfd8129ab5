"""torch.compile for training, block by block (``--compile``), and what compiling cost.

Each repeated transformer block's ``forward`` is compiled with ``torch.compile`` (TorchInductor, default mode), as
torchtitan does, rather than the whole model:

- The blocks share their code, and dynamo turns their parameters into graph inputs (``inline_inbuilt_nn_modules``)
  instead of guarding on each module: ONE graph serves every block, so a 12-block model compiles as fast as a 2-block
  one and never nears dynamo's recompile limit (8 per function) through depth.
- Applied AFTER activation checkpointing: the forward compiled is then the checkpointed one; dynamo traces
  ``torch.utils.checkpoint`` into the graph and the compiled backward recomputes what it was told not to keep.
- Applied BEFORE DDP / FSDP2 wrapping: FSDP2 all-gathers a block's parameters in a forward pre-hook and frees them in
  a post-hook, module hooks that run around ``forward``, so communication stays eager around the compiled compute;
  DDP's gradient hooks sit on the parameters' AccumulateGrad nodes, which the compiled backward feeds as eager does.
- The instance's ``forward`` is replaced, as recompute replaces it, instead of wrapping the block in an
  ``OptimizedModule``: parameter names and ``state_dict`` keys stay exactly as the model has them, so checkpoints,
  ``model.safetensors`` and ``--resume`` are the same with and without ``--compile``.

Compiling happens on first use: the first training step (forward, and the backward when it first runs), the first
evaluation (no-grad is a graph of its own), and each new input shape (the second length seen makes the sequence
dimension dynamic, after which lengths reuse that graph). Its cost is read from dynamo's own compile-time accounting
(:func:`compile_stats`), which is process-wide, so a run reports the difference over its own lifetime
(:class:`CompileClock`): several runs in one process (tests, notebooks) each see only their own compiling.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from cadence.models.blocks import repeated_blocks


def compile_blocks(model: nn.Module) -> int:
    """Compile the ``forward`` of each repeated block of ``model`` in place; returns the number of blocks.

    Call it after activation checkpointing and before DDP/FSDP2 wrapping (see the module's docstring). Raises
    ValueError when the model has no list of blocks or its blocks are compiled already. Nothing compiles until the
    first forward."""
    blocks = repeated_blocks(model)
    for block in blocks:
        if getattr(block, "_cadence_compiled", False):
            raise ValueError("torch.compile is already applied to this model's blocks")
        # A bound method (or recompute's wrapper around one) compiled as a function: the module stays what it was.
        block.forward = torch.compile(block.forward)
        setattr(block, "_cadence_compiled", True)  # a mark, not a tensor or module (all nn.Module's type takes)
    return len(blocks)


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot run on ``device`` in this installation, or None when it can.

    Checked before a run starts, so that ``--compile`` fails with one clear line rather than minutes later inside
    the first step: dynamo must support this Python, inductor needs a working C++ compiler for CPU kernels (the one
    it would use itself: ``torch._inductor.config.cpp.cxx``, i.e. ``$CXX`` or g++) and Triton for CUDA kernels."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return f"torch.compile does not support Python {version} in torch {torch.__version__}; run without --compile"
    if device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()  # runs `<compiler> --version` once per process, as inductor does before its first build
        except RuntimeError:  # torch._inductor.exc.InvalidCxxCompiler
            tried = ", ".join(str(name) for name in inductor_config.cpp.cxx if name)
            return (f"inductor builds CPU kernels with a C++ compiler and none works here (tried {tried}); install "
                    f"g++ or point $CXX at one, or run without --compile")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor builds CUDA kernels with Triton, which is not installed (pip install triton)"
    return None


@dataclass(frozen=True)
class CompileStats:
    """What torch.compile has done: process-wide totals (:func:`compile_stats`) or a difference of two."""

    seconds: float = 0.0
    """Wall time compiling: dynamo's tracing plus AOT autograd and inductor for the forward graphs, and the
    backward graphs compiled when they first ran (dynamo's ``entire_frame_compile`` + ``entire_backward_compile``).
    Cached kernels (``/tmp/torchinductor_$USER``) make a repeat compile much cheaper than the first."""
    graphs: int = 0
    """Graphs dynamo captured and compiled: one per block code for training, one more for no-grad evaluation, one
    per recompile (a new shape, the recompute mode's grad switch) and one per piece around a graph break."""
    graph_breaks: int = 0
    """Places where dynamo fell back to Python inside a block (each splits a graph in two)."""

    def since(self, earlier: CompileStats) -> CompileStats:
        """The difference from ``earlier``; a counter that went down (``torch._dynamo.reset()`` clears the time
        accounting) counts from zero."""

        def delta(now: float, then: float) -> float:
            return now - then if now >= then else now

        return CompileStats(seconds=delta(self.seconds, earlier.seconds),
                            graphs=int(delta(self.graphs, earlier.graphs)),
                            graph_breaks=int(delta(self.graph_breaks, earlier.graph_breaks)))


def compile_stats() -> CompileStats:
    """This process's compile totals so far, from dynamo's own accounting."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return CompileStats(seconds=calculate_time_spent().get("total_wall_time", 0.0),
                        graphs=int(counters["stats"]["unique_graphs"]),
                        graph_breaks=int(sum(counters["graph_break"].values())))


class CompileClock:
    """torch.compile's cost from this clock's start: in total, and lap by lap (one training step at a time)."""

    def __init__(self) -> None:
        self._start = self._lap = compile_stats()

    def lap(self) -> float:
        """Seconds spent compiling since the last lap (or the start)."""
        now = compile_stats()
        seconds = now.since(self._lap).seconds
        self._lap = now
        return seconds

    def total(self) -> CompileStats:
        """Everything compiled since the start."""
        return compile_stats().since(self._start)
