"""The runtime's public API: an engine built from a target folder (or a strata-setup config) that generates text
with speculative decoding and reports its memory by name (docs/INTERFACES.md)."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime import cpu_ops, target_compiled
from runtime.artifact_check import check_config_artifacts
from runtime.config import StrataConfig, load, parse
from runtime.detok import IncrementalDetokenizer
from runtime.drafters.registry import KINDS, LoadRequest
from runtime.errors import ConfigError, LoadError, UsageError
from runtime.experts import ExpertCache
from runtime.gpu import fallback
from runtime.kv import KV_QUANTS, KVCache
from runtime.loading import default_dtype, load_target, load_tokenizer
from runtime.memory import NAMES, buffers_bytes, cap_device_memory, default_prefill_chunk, target_dense_bytes
from runtime.paths import compiled_dir
from runtime.routing_profile import RoutingProfile
from runtime.sampling import SamplingParams
from runtime.speculative import MAX_DRAFT_TEMP_SCALE, generate_ids

__all__ = ["Engine", "EngineConfigError", "GenerateResult", "SamplingParams"]

MTP_DEFAULT_BLOCK = KINDS["mtp"].default_block(None)
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


# a config or argument the engine cannot use: the config error of runtime/errors.py (one class, exit code 2)
EngineConfigError = ConfigError


@dataclass
class GenerateResult:
    token_ids: list[int]
    text: str
    stats: dict[str, Any] = field(default_factory=dict)


def _dtype(x: str | torch.dtype | None) -> torch.dtype | None:
    if x is None or isinstance(x, torch.dtype):
        return x
    if x not in _DTYPES:
        raise EngineConfigError(f"unknown dtype {x!r}; use one of {', '.join(sorted(_DTYPES))}.")
    return _DTYPES[x]


def _kv_format(x: str | torch.dtype | None, dt: torch.dtype) -> tuple[torch.dtype, str | None]:
    """`[memory] kv_dtype` -> (the KV cache's compute dtype, its 8-bit format or None). "q8_0" keeps the target's
    cache in 8 bits (runtime/kv.py); the drafters' caches stay in the compute dtype."""
    if isinstance(x, str) and x in KV_QUANTS:
        return dt, x
    if isinstance(x, str) and x not in _DTYPES:
        raise EngineConfigError(f"unknown kv_dtype {x!r}; use one of {', '.join(sorted(_DTYPES) + list(KV_QUANTS))}.")
    return _dtype(x) or dt, None


def _device(x: str | torch.device | None) -> torch.device:
    if x is None or x == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(x)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise EngineConfigError(f"unknown device {x!r}; set the config's [device] type to cpu, cuda or auto.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError("the config asks for a CUDA device but none is available; set device type to cpu.")
    return dev


def _stop_ids(folder: Path, cfg_eos: list[int]) -> set[int]:
    ids = set(cfg_eos)
    gc = folder / "generation_config.json"
    if gc.is_file():
        try:
            eos = json.loads(gc.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


def _load_target(target: Path, dtype: torch.dtype, *, with_mtp: bool):
    """(model on the CPU, tokenizer) from a Hugging Face folder or a qwen3moe GGUF file (runtime/loading_gguf.py:
    its tokenizer comes from the file's metadata, so the file runs by itself)."""
    from runtime.loading_gguf import is_gguf, load_target_gguf, load_tokenizer_gguf

    if is_gguf(target):
        return load_target_gguf(target, device="cpu", dtype=dtype, with_mtp=with_mtp), load_tokenizer_gguf(target)
    return load_target(target, device="cpu", dtype=dtype, with_mtp=with_mtp), load_tokenizer(target)


class Engine:
    def __init__(self, *, model, tokenizer, kv: KVCache, drafter, drafter_kind: str, experts: ExpertCache,
                 device: torch.device, block: int, spec_min_p: float, stop_ids: set[int], target_dir: Path,
                 prefill_chunk: int = 512, graphs: bool = True, draft_temp_scale: float = 1.0) -> None:
        self.model, self.tokenizer, self.kv, self.drafter = model, tokenizer, kv, drafter
        self.graphs = graphs
        # runtime.gpu.static_step.StaticStep by width, target_compiled.CompiledTargetStep by ("compiled", width)
        self.steps: dict[Any, Any] = {}
        self.step = None                  # the step the last generate used
        self.drafter_kind, self.experts, self.device = drafter_kind, experts, device
        self.block, self.spec_min_p, self.stop_ids = block, spec_min_p, stop_ids
        self.draft_temp_scale = draft_temp_scale      # sampled drafts at the request's temperature times this
        self.target_dir, self.prefill_chunk = target_dir, prefill_chunk
        self.compiled_why = ""               # why the drafter runs eagerly on a CPU (`compile_drafter`)
        self.compile_s = 0.0                 # what the last `compile_drafter` took (a build, or a load)
        self.target_packages: dict[str, Any] = {}   # CPU: the target step's compiled packages by mode (`compile_target`)
        self.target_why = ""                 # why a target step runs eagerly on a CPU ("" when none does)
        self.target_compile_s = 0.0
        self.attention_why = "no compiled target step"  # why its attention is not the C++ op ("": it is)
        rows = drafter.max_block if drafter is not None else 1
        self.logits_buf = torch.zeros(rows, model.cfg.vocab_size, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------------------------------------ building
    @classmethod
    def build(cls, target_dir: str | Path, drafter_kind: str = "none", drafter_path: str | Path | None = None,
              device: str | torch.device | None = None, dtype: str | torch.dtype | None = None, context: int = 4096,
              expert_slots: int | None = None, block: int | None = None, spec_min_p: float | None = None,
              kv_dtype: str | torch.dtype | None = None, prefill_chunk: int | None = None, graphs: bool = True,
              expert_miss: str = "auto", routing_profile: str | Path | RoutingProfile | None = None,
              expert_lru_slots: int = 0, vram_limit_mib: int | None = None,
              draft_temp_scale: float | None = None) -> Engine:
        """Load the target (and drafter) onto `device` (default: CUDA when present); BF16 on CUDA, fp32 on CPU.
        With fewer `expert_slots` than experts (CUDA), the routing profile (a file recorded by calibration) places
        the slots and `expert_miss` says how the other experts are served (runtime/experts.py). `vram_limit_mib`
        caps what this process may reserve on the GPU (runtime/memory.py `cap_device_memory`). `kv_dtype`: a dtype
        name or "q8_0" (the target's KV cache in 8 bits); `prefill_chunk`: prompt tokens per prefill forward
        (default per device, runtime/memory.py). `target_dir` is a Hugging Face folder or a qwen3moe `.gguf` file
        (docs/formats.md)."""
        if drafter_kind not in KINDS:
            raise EngineConfigError(f"unknown drafter kind {drafter_kind!r}; use one of {', '.join(KINDS)}.")
        if int(context) < 2:
            raise EngineConfigError(f"context must be at least 2 tokens, got {context}.")
        if block is not None and int(block) < 1:
            raise EngineConfigError(f"block must be >= 1, got {block}.")
        if spec_min_p is not None and not 0 <= float(spec_min_p) <= 1:
            raise EngineConfigError(f"spec_min_p must be in [0, 1], got {spec_min_p}.")
        if draft_temp_scale is not None and not 0 < float(draft_temp_scale) <= MAX_DRAFT_TEMP_SCALE:
            raise EngineConfigError(f"draft_temp_scale must be in (0, {MAX_DRAFT_TEMP_SCALE}], got "
                                    f"{draft_temp_scale}.")
        if prefill_chunk is not None and int(prefill_chunk) < 1:
            raise EngineConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}.")
        dev = _device(device)
        prefill_chunk = int(prefill_chunk or default_prefill_chunk(dev.type))
        if vram_limit_mib is not None and dev.type == "cuda":
            cap_device_memory(vram_limit_mib, dev.index or 0)
        dt = _dtype(dtype) or default_dtype(dev)
        kdt, kv_quant = _kv_format(kv_dtype, dt)
        target_dir = Path(target_dir).expanduser()
        profile = routing_profile
        if profile is not None and not isinstance(profile, RoutingProfile):
            profile = RoutingProfile.load(Path(profile).expanduser())
        model, tokenizer = _load_target(target_dir, dt, with_mtp=drafter_kind == "mtp")
        limit = model.cfg.max_position_embeddings
        if int(context) > limit:
            raise EngineConfigError(f"context {int(context)} is beyond the model's maximum of {limit} tokens; set "
                                    f"[memory] context to {limit} or less (or rerun strata-setup).")
        experts = ExpertCache(model, dev, expert_slots, miss=expert_miss, profile=profile,
                              lru_slots=int(expert_lru_slots))
        experts.place(model)
        cfg = model.cfg
        try:
            # a float CPU cache gets the compiled step's room past its end (runtime/target_compiled.py)
            spare = target_compiled.spare_slots(int(context)) if dev.type == "cpu" and kv_quant is None else 0
            kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, int(context), dtype=kdt,
                         device=dev, quant=kv_quant, spare=spare)
        except ValueError as e:
            raise EngineConfigError(str(e)) from None
        kind = KINDS[drafter_kind]
        if drafter_kind == "mtp" and model.mtp is None:
            raise LoadError(f"target {target_dir} has no MTP head (no mtp.* tensors, or no MTP file beside the GGUF); "
                            f"use another drafter.")
        if kind.needs_file and drafter_path is None:
            raise EngineConfigError(f"a {drafter_kind} drafter needs its artifact path (drafter.path in the config).")
        drafter = kind.load(LoadRequest(target=model, path=Path(drafter_path).expanduser() if drafter_path else None,
                                        device=dev, dtype=dt, kv_dtype=kdt, context=int(context), block=block))
        if drafter is None:
            block = 1
        elif block is None:
            block = kind.default_block(getattr(drafter, "geom", None))   # DFlash2: the head's own block_size
        if spec_min_p is None:       # no configured floor: the kind's uncalibrated default (an explicit 0 wins)
            spec_min_p = kind.default_spec_min_p if drafter is not None else 0.0
        # the static step's width (runtime/gpu/static_step.py): the pool keeps enough dynamic slots for its misses
        experts.ensure_window(drafter.max_block if drafter is not None else 1)
        eng = cls(model=model, tokenizer=tokenizer, kv=kv, drafter=drafter, drafter_kind=drafter_kind,
                   experts=experts, device=dev, block=int(block), spec_min_p=float(spec_min_p),
                   stop_ids=_stop_ids(target_dir, cfg.eos_token_id), target_dir=target_dir,
                   prefill_chunk=prefill_chunk, graphs=graphs,
                   draft_temp_scale=1.0 if draft_temp_scale is None else float(draft_temp_scale))
        eng.compile_target(build=False)
        eng.compile_drafter(build=False)
        return eng

    @property
    def target_taps(self) -> tuple[int, ...]:
        """The layers whose outputs this engine's drafter reads from the target's step."""
        return tuple(getattr(self.drafter, "tap_layers", ())) if self.drafter is not None else ()

    def compile_target(self, build: bool = False) -> str:
        """CPU: attach the target step's compiled packages from the store (compiled/, runtime/paths.py): the one-row
        step, and with a drafter the wide one (runtime/target_compiled.py); built first when `build` is set and
        this machine has none (strata-setup does, before calibrating). Returns "" when every step this engine runs
        is compiled, else why not (`target_why`)."""
        t0 = time.perf_counter()
        self.attention_why = "no compiled target step"
        if self.device.type != "cpu":
            self.target_packages, self.target_why = {}, "not on a CPU"
        else:
            modes = ("one", "wide") if self.drafter is not None else ("one",)
            self.target_packages, self.target_why = target_compiled.attach(
                self.model, self.kv, self.target_taps, modes, compiled_dir(), build)
            if self.target_packages:              # whether their attention is the C++ op (runtime/cpu_ops.py)
                self.attention_why = cpu_ops.ensure(compiled_dir(), build=False)
        self.steps.clear()
        self.step = None
        self.target_compile_s = time.perf_counter() - t0
        return self.target_why

    def compile_drafter(self, build: bool = False) -> str:
        """Attach the drafter's compiled CPU step from the store (compiled/, runtime/paths.py), building it first
        when `build` is set and this machine has none (strata-setup does, before calibrating). Returns "" when
        the drafter runs compiled, else why not (`compiled_why`; "" too for a drafter without such a step)."""
        t0 = time.perf_counter()
        use = getattr(self.drafter, "use_compiled", None)
        self.compiled_why = "no compiled step for this drafter" if use is None or self.device.type != "cpu" \
            else use(compiled_dir(), build=build)
        self.compile_s = time.perf_counter() - t0
        return self.compiled_why

    def compile_missing(self, say: Callable[[str], None]) -> None:
        """CPU: build the compiled steps this machine has not got yet (a config set up without calibration, or a
        context changed since), telling `say` first: strata-setup normally builds them."""
        missing = "not built for this machine yet"
        if self.target_why.startswith(missing):
            say("compiling the target's step for this CPU (once per machine, about 20 s a package; "
                "STRATA_COMPILE=0 skips it)")
            self.compile_target(build=True)
        if self.compiled_why.startswith(missing):
            say("compiling the drafter's step for this CPU (once per machine, about 10 s)")
            self.compile_drafter(build=True)

    @property
    def drafter_compiled(self) -> bool:
        return getattr(self.drafter, "compiled", None) is not None

    @classmethod
    def from_config(cls, config: str | Path | dict | StrataConfig, **overrides: Any) -> Engine:
        """Build from a strata-setup config (a file, its dict or a parsed `StrataConfig`; runtime/config.py checks
        every key). Relative paths are relative to the file. Artifacts changed since setup are refused first."""
        if isinstance(config, StrataConfig):
            cfg = config
        elif isinstance(config, dict):
            cfg = parse(config)
        else:
            p = Path(config).expanduser()
            if not p.is_file():
                raise EngineConfigError(f"config file {p} does not exist; run strata-setup first or pass --config.")
            cfg = load(p)
        check_config_artifacts(cfg)
        kind = cfg.drafter.kind
        args: dict[str, Any] = dict(
            target_dir=cfg.resolve(cfg.target.path), drafter_kind=kind,
            drafter_path=cfg.resolve(cfg.drafter.path) if kind != "none" else None,
            device=cfg.device.type, dtype=cfg.device.dtype, context=cfg.memory.context,
            expert_slots=cfg.memory.expert_cache_slots, block=cfg.speculative.block,
            spec_min_p=cfg.speculative.spec_min_p, kv_dtype=cfg.memory.kv_dtype,
            draft_temp_scale=cfg.speculative.draft_temp_scale,
            prefill_chunk=cfg.memory.prefill_chunk,
            expert_miss=cfg.memory.expert_miss, routing_profile=cfg.resolve(cfg.memory.routing_profile),
            expert_lru_slots=cfg.memory.expert_lru_slots, vram_limit_mib=cfg.device.vram_limit_mib,
        )
        args.update(overrides)
        return cls.build(**args)

    # ------------------------------------------------------------------------------------------------ running
    @property
    def step_width(self) -> int:
        """Rows of this engine's fixed-width target step: its configured block (1 without a drafter), for drafted
        and target-only windows alike (docs/models.md, "Numerics")."""
        return min(self.block, self.drafter.max_block) if self.drafter is not None else 1

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 block: int | None = None, spec_min_p: float | None = None, draft: bool = True,
                 stop_ids: set[int] | None = None, on_text: Callable[[str], None] | None = None,
                 cancel: Callable[[], bool] | None = None, width: int | None = None,
                 draft_temp_scale: float | None = None) -> GenerateResult:
        """Generate after `prompt` (text or token ids). The output is the target's, whatever the drafter does.
        `cancel()` is asked between windows (from this thread); True stops there, stop_reason "cancelled".

        `width`: the fixed step's rows for this run; default the engine's `step_width`, widened to `block`
        when a run asks for wider windows. Greedy output is bit-identical between runs of the same width.
        `draft_temp_scale`: this run's (default the engine's, `[speculative] draft_temp_scale`)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise EngineConfigError("the prompt is empty after tokenization; give some text.")
        if len(ids) + 1 > self.kv.capacity:
            self.check_room(ids, 0)          # the one message, with advice that fits this context
        use = self.drafter if (draft and self.drafter is not None) else None
        blk = int(block if block is not None else self.block) if use is not None else 1
        if use is not None:
            blk = min(blk, use.max_block)
        widest = self.drafter.max_block if self.drafter is not None else 1
        if width is None:
            width = max(self.step_width, blk)
        elif not blk <= int(width) <= widest:
            # wider than the drafter's largest window would resize the expert pool under captured graphs
            raise EngineConfigError(f"width {width} must be between the block {blk} and the drafter's largest "
                                    f"window {widest}.")
        mp = float(spec_min_p if spec_min_p is not None else self.spec_min_p)
        detok = IncrementalDetokenizer(self.tokenizer)

        def on_tokens(new: list[int]) -> None:
            if on_text is not None:
                piece = detok.push(new)
                if piece:
                    on_text(piece)

        self.experts.reset_counters()
        res = generate_ids(self.model, self.kv, ids, drafter=use, max_new_tokens=max_new_tokens,
                           sampling=sampling, block=blk, spec_min_p=mp,
                           stop_ids=self.stop_ids if stop_ids is None else set(stop_ids),
                           prefill_chunk=self.prefill_chunk, on_tokens=on_tokens, logits_buf=self.logits_buf,
                           step=self.static_step(int(width)), should_stop=cancel,
                           draft_temp_scale=float(self.draft_temp_scale if draft_temp_scale is None
                                                  else draft_temp_scale))
        text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        if on_text is not None and (rest := detok.flush()):
            on_text(rest)
        stats = dict(res.stats)
        drafted = use is not None and blk > 1           # block 1 (calibration's "target_alone"): no drafting
        stats.update(drafter=self.drafter_kind if drafted else "none", device=self.device_name,
                     drafter_compiled=drafted and self.drafter_compiled,
                     target_compiled=isinstance(self.step, target_compiled.CompiledTargetStep),
                     stop_reason=res.stop_reason, expert_cache=self.experts.stats(),
                     fallbacks=list(fallback.SEEN))
        return GenerateResult(token_ids=res.token_ids, text=text, stats=stats)

    def use_routing_profile(self, profile: RoutingProfile) -> None:
        """Place the expert slots by `profile` (offloaded experts only; otherwise it is just kept); the steps'
        captured graphs read the old pool, so the steps are rebuilt at the next window."""
        if self.experts.use_profile(profile):
            self.steps.clear()
            self.step = None

    def record_routing(self, on: bool = True) -> None:
        """Count every MoE layer's router choices from now on (`experts.routing_profile()` reads them); the
        captured step graphs are dropped so the next ones include (or leave out) the counting."""
        self.experts.record_routing(on)
        for st in self.steps.values():
            if hasattr(st, "graphs"):
                st.graphs.clear()

    def room(self, n_prompt: int) -> int:
        """How many tokens a prompt of `n_prompt` tokens leaves room for: the first comes from the prompt's last
        row, each later one needs the position of the token before it (0 when the prompt does not fit)."""
        return self.kv.capacity - int(n_prompt) + 1 if n_prompt + 1 <= self.kv.capacity else 0

    def context_advice(self) -> str:
        """What a user can do about the context: raise it (up to the model's maximum); nothing when it is already
        the maximum."""
        limit = self.model.cfg.max_position_embeddings
        if self.kv.capacity < limit:
            return f", or raise [memory] context in the config (this model allows up to {limit} tokens)"
        return f" ({self.kv.capacity} tokens is already this model's maximum context)"

    def check_room(self, prompt: str | list[int], max_new_tokens: int, *, flag: str = "max_new_tokens") -> None:
        """Refuse up front (UsageError, exit 2) a prompt that does not fit the context, or more new tokens than the
        context leaves room for, instead of stopping short without a word."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        n, cap = len(ids), self.kv.capacity
        if n + 1 > cap:
            raise UsageError(f"the prompt has {n} tokens and does not fit the context of {cap} tokens; shorten "
                             f"it{self.context_advice()}.")
        room = self.room(n)
        if max_new_tokens > room:
            raise UsageError(f"{flag} {max_new_tokens} does not fit: after the {n}-token prompt the context of {cap} "
                             f"tokens leaves room for {room} new tokens; pass {flag} {room} or "
                             f"less{self.context_advice()}.")

    def choose_threads(self):
        """The torch thread count for this engine on a CPU: runtime/hostinfo.py's measured choice, its probe shaped
        like this model's decode work (the hidden size; the routed experts' or dense MLP's width)."""
        from runtime.hostinfo import choose_threads

        c = self.model.cfg
        routed = int(getattr(c, "moe_intermediate_size", 0) or 0) * int(getattr(c, "num_experts_per_tok", 1) or 1)
        return choose_threads(hidden=c.hidden_size, inner=max(routed, c.hidden_size))

    def encode(self, text: str) -> list[int]:
        """The token ids `generate` uses for a text prompt (callers that must count them first use this too)."""
        return self.tokenizer.encode(text).ids

    @property
    def context(self) -> int:
        """Tokens the KV cache holds: prompt plus generated tokens must fit in it."""
        return self.kv.capacity

    def static_step(self, width: int | None = None):
        """The fixed-width decode/verify step of `width` rows (default `step_width`: the configured block, 1 without
        a drafter): a CUDA graph on CUDA, eager row-invariant torch on the CPU (runtime/gpu/static_step.py).
        Target-only decoding of this engine runs at the same width as its drafted windows, so greedy output is the
        same bits with and without drafting, and a narrow block or an engine without a drafter does not pay for
        rows it never fills (docs/models.md, "Numerics")."""
        cuda = self.device.type == "cuda"
        w = int(width if width is not None else self.step_width)
        mode = target_compiled.mode_for(w)
        if mode in self.target_packages and target_compiled.fits(self.model, self.kv) is None:
            # CPU: every window of the run through the compiled package (runtime/target_compiled.py)
            key = ("compiled", w)
            if key not in self.steps:
                self.steps[key] = target_compiled.CompiledTargetStep(self.model, self.kv, w,
                                                                     self.target_packages[mode], mode,
                                                                     self.target_taps)
            self.step = self.steps[key]
            return self.step
        if w not in self.steps:
            from runtime.gpu.static_step import StaticStep

            self.steps[w] = StaticStep(self.model, self.kv, w, graph=self.graphs and cuda)
            if cuda and self.graphs and self.drafter is not None and getattr(self.drafter, "graphs", False) is None:
                self.drafter.graphs = self.drafter.make_graphs()
        self.step = self.steps[w]
        return self.step

    # ------------------------------------------------------------------------------------------------ reporting
    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return f"cpu ({platform.machine() or 'unknown'})"

    def memory_report(self) -> dict[str, int]:
        """Persistent buffers by name (bytes), measured on the real tensors."""
        rep = dict.fromkeys(NAMES, 0)
        # with the compiled CPU step's bf16 copies of the products' weights (runtime/target_compiled.py)
        rep["target_dense_weights"] = target_dense_bytes(self.model) + target_compiled.copies_nbytes(self.model)
        rep["expert_cache"] = self.experts.resident_nbytes
        rep["target_kv"] = self.kv.nbytes
        rep["logits"] = self.logits_buf.numel() * self.logits_buf.element_size()
        rep["scratch"] = buffers_bytes(self.model) + self.kv.scratch_nbytes
        if self.step is not None and self.step.part is not None:
            rep["scratch"] += self.step.part.numel() * self.step.part.element_size()
        if self.drafter is not None:
            if hasattr(self.drafter, "memory_report"):
                for k, v in self.drafter.memory_report().items():
                    rep[k] = rep.get(k, 0) + int(v)
            elif isinstance(self.drafter, torch.nn.Module):
                rep["drafter_weights"] += sum(p.numel() * p.element_size() for p in self.drafter.parameters())
        return rep
