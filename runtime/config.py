"""The config schema (docs/config.md): the TOML document `strata-setup` writes and `strata-run`, `strata-serve`,
calibration, the budget command and the store's reference scan read. One parser, so every command agrees on what a
valid config is: every key's type and range is checked here, with one sentence naming the key.

`parse` turns a document (a dict from TOML) into a `StrataConfig`; `StrataConfig.to_doc` turns it back. Keys this
schema does not know are kept (per table) and written back, so a user's own keys survive a rerun of setup.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.drafters.registry import KINDS
from runtime.errors import ConfigError
from runtime.formats.registry import FORMATS, QTYPES

SCHEMA = 1
DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")
KV_DTYPES = DTYPES + ("q8_0",)     # q8_0: the target's KV cache in 8 bits (runtime/kv.py)
DEVICE_TYPES = ("auto", "cpu", "cuda")
SETTING_SOURCES = ("default", "calibrated", "user")
EXPERT_MISS = ("auto", "stream", "cpu", "legacy")   # how experts off the GPU are served (runtime/experts.py)


# ------------------------------------------------------------------------------------------------------- the tables

@dataclass
class FileRecord:
    """A verified file: what it was when setup checked it."""

    sha256: str
    size: int
    mtime_ns: int | None = None


@dataclass
class TargetSection:
    path: str
    name: str = ""
    source: str = "local"                     # bundled | hf | local
    sha256: str = ""
    revision: str | None = None
    has_mtp: bool | None = None
    quantization: str | None = None           # how the target is stored (docs/formats.md); None: bf16
    source_sha256: str | None = None          # a converted target: the checkpoint it was converted from
    source_path: str | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)


@dataclass
class DrafterSection:
    kind: str = "none"
    head: str | None = None
    path: str | None = None
    sha256: str | None = None
    size: int | None = None
    mtime_ns: int | None = None
    quantization: str | None = None
    source_sha256: str | None = None
    source_path: str | None = None


@dataclass
class SpeculativeSection:
    block: int | None = None
    spec_min_p: float | None = None
    source: str = "default"                  # default | calibrated | user
    draft_temp_scale: float | None = None    # sampled drafts at the request's temperature times this (None: 1)


@dataclass
class MemorySection:
    context: int = 4096
    dtype: str | None = None
    kv_dtype: str | None = None
    prefill_chunk: int | None = None          # prompt tokens per prefill forward (None: runtime/memory.py's default)
    reserve_mib: int = 0
    expert_cache_slots: int | None = None
    total_experts: int | None = None
    expert_bytes: int | None = None
    expert_miss: str = "auto"                 # auto | stream | cpu | legacy
    expert_lru_slots: int = 0                 # dynamic slots beyond what one verify window needs
    routing_profile: str | None = None        # the routing profile calibration recorded (places the slots)
    budget: dict[str, int] = field(default_factory=dict)


@dataclass
class DeviceSection:
    type: str = "auto"
    name: str | None = None
    total_mib: int | None = None
    free_mib: int | None = None
    capability: str | None = None
    dtype: str | None = None
    vram_limit_mib: int | None = None         # cap on what the runtime may reserve on the GPU (--vram-limit-mib)


@dataclass
class StrataConfig:
    target: TargetSection
    drafter: DrafterSection = field(default_factory=DrafterSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    memory: MemorySection = field(default_factory=MemorySection)
    device: DeviceSection = field(default_factory=DeviceSection)
    calibration: dict[str, Any] = field(default_factory=dict)   # calibrate's own record (calibrate/results.py)
    schema: int = SCHEMA
    created_by: str | None = None
    base: Path = field(default_factory=Path.cwd)   # relative paths are relative to this (the file's folder)
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)   # keys this schema does not know, by table

    def resolve(self, p: str | None) -> Path | None:
        """A path from the config: `~` expanded, relative to the config file's folder."""
        if p is None:
            return None
        q = Path(p).expanduser()
        return q if q.is_absolute() else self.base / q

    def to_doc(self) -> dict[str, Any]:
        """The TOML document (None values left out: TOML has no null), user keys included."""
        doc: dict[str, Any] = dict(self.extra.get("", {}))
        doc.update(schema=self.schema, created_by=self.created_by)
        for name, sec in (("target", self.target), ("drafter", self.drafter), ("speculative", self.speculative),
                          ("memory", self.memory), ("device", self.device)):
            t = dict(self.extra.get(name, {}))
            for f in fields(sec):
                v = getattr(sec, f.name)
                if f.name == "files":
                    v = {rel: tomlable(vars(r)) for rel, r in v.items()}
                t[f.name] = v
            doc[name] = t
        if self.calibration:
            doc["calibration"] = dict(self.calibration)
        return tomlable(doc)


def tomlable(value: Any) -> Any:
    """TOML has no null and needs string keys: drop None values, stringify keys and paths."""
    if isinstance(value, Mapping):
        return {str(k): tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [tomlable(v) for v in value if v is not None]
    if isinstance(value, Path):
        return str(value)
    return value


# ------------------------------------------------------------------------------------------------------- checking

class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, value: Any, what: str) -> ConfigError:
        return ConfigError(f"The config {self.where} has '{key}' = {value!r}, which is not {what}; fix it or rerun "
                           f"strata-setup.")

    def get(self, table: Mapping[str, Any], tname: str, key: str, kind: str, default: Any = None, *,
            choices: tuple[str, ...] | None = None, lo: float | None = None, hi: float | None = None) -> Any:
        if key not in table or table[key] is None:
            return default
        v = table[key]
        name = f"{tname}.{key}" if tname else key
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.fail(name, v, "a whole number")
        elif kind == "float":
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise self.fail(name, v, "a number")
            v = float(v)
        elif kind == "bool":
            if not isinstance(v, bool):
                raise self.fail(name, v, "true or false")
        elif kind == "str":
            if not isinstance(v, str):
                raise self.fail(name, v, "a string")
        if choices is not None and v not in choices:
            noun = name.replace(".", " ").replace("_", " ")
            raise ConfigError(f"The config {self.where} has an unknown {noun} {v!r} ('{name}'); use one of "
                              f"{', '.join(choices)}.")
        if lo is not None and v < lo:
            raise self.fail(name, v, f"at least {lo:g}")
        if hi is not None and v > hi:
            raise self.fail(name, v, f"at most {hi:g}")
        return v

    def table(self, doc: Mapping[str, Any], name: str, required: bool = False) -> dict[str, Any]:
        t = doc.get(name)
        if t is None:
            if required:
                raise ConfigError(f"The config {self.where} has no [{name}] table; rerun strata-setup to rewrite it.")
            return {}
        if not isinstance(t, Mapping):
            raise ConfigError(f"The config {self.where} has '{name}' = {t!r}, which is not a table; fix it or rerun "
                              f"strata-setup.")
        return dict(t)


def _unknown(table: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    return {k: v for k, v in table.items() if k not in known}


def parse(doc: Mapping[str, Any], *, where: str = "", base: Path | None = None,
          complete: bool = False) -> StrataConfig:
    """Check `doc` against the schema and return it typed. `complete`: also require the tables strata-setup always
    writes ([drafter], [memory] with its context), for the commands that work on a setup (budget, calibrate)."""
    c = _Checker(where or "(in memory)")
    if not isinstance(doc, Mapping):
        raise ConfigError(f"The config {c.where} is not a TOML table; rerun strata-setup.")
    schema = doc.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise ConfigError(f"The config {c.where} has schema {schema!r}, but this version reads schema {SCHEMA}; "
                          f"rerun strata-setup.")
    t = c.table(doc, "target")
    if "path" not in t:
        raise ConfigError(f"The config {c.where} has no [target] path; rerun strata-setup.")
    files: dict[str, FileRecord] = {}
    raw_files = c.table(t, "files") if "files" in t else {}
    for rel, meta in raw_files.items():
        if not isinstance(meta, Mapping):
            raise c.fail(f"target.files.{rel}", meta, "a table")
        files[str(rel)] = FileRecord(
            sha256=c.get(meta, f"target.files.{rel}", "sha256", "str", ""),
            size=c.get(meta, f"target.files.{rel}", "size", "int", -1, lo=0),
            mtime_ns=c.get(meta, f"target.files.{rel}", "mtime_ns", "int"))
    target = TargetSection(
        path=c.get(t, "target", "path", "str"), name=c.get(t, "target", "name", "str", ""),
        source=c.get(t, "target", "source", "str", "local"), sha256=c.get(t, "target", "sha256", "str", ""),
        revision=c.get(t, "target", "revision", "str"), has_mtp=c.get(t, "target", "has_mtp", "bool"),
        quantization=c.get(t, "target", "quantization", "str", choices=tuple(FORMATS)),
        source_sha256=c.get(t, "target", "source_sha256", "str"), source_path=c.get(t, "target", "source_path", "str"),
        files=files)

    d = c.table(doc, "drafter", required=complete)
    if complete and "kind" not in d:
        raise ConfigError(f"The config {c.where} has no 'drafter.kind'; rerun strata-setup to rewrite it.")
    drafter = DrafterSection(
        kind=c.get(d, "drafter", "kind", "str", "none", choices=tuple(KINDS)),
        head=c.get(d, "drafter", "head", "str"), path=c.get(d, "drafter", "path", "str"),
        sha256=c.get(d, "drafter", "sha256", "str"), size=c.get(d, "drafter", "size", "int", lo=0),
        mtime_ns=c.get(d, "drafter", "mtime_ns", "int"),
        quantization=c.get(d, "drafter", "quantization", "str", choices=QTYPES + ("native",)),
        source_sha256=c.get(d, "drafter", "source_sha256", "str"), source_path=c.get(d, "drafter", "source_path", "str"))

    s = c.table(doc, "speculative")
    spec = SpeculativeSection(
        block=c.get(s, "speculative", "block", "int", lo=1), spec_min_p=c.get(s, "speculative", "spec_min_p", "float",
                                                                             lo=0, hi=1),
        source=c.get(s, "speculative", "source", "str", "default", choices=SETTING_SOURCES),
        draft_temp_scale=c.get(s, "speculative", "draft_temp_scale", "float", lo=0.05, hi=4.0))

    m = c.table(doc, "memory", required=complete)
    if complete and "context" not in m:
        raise ConfigError(f"The config {c.where} has no 'memory.context'; rerun strata-setup to rewrite it.")
    budget = c.table(m, "budget") if "budget" in m else {}
    for k in budget:
        c.get(budget, "memory.budget", k, "int", lo=0)
    mem = MemorySection(
        context=c.get(m, "memory", "context", "int", 4096, lo=2),
        dtype=c.get(m, "memory", "dtype", "str", choices=DTYPES),
        kv_dtype=c.get(m, "memory", "kv_dtype", "str", choices=KV_DTYPES),
        prefill_chunk=c.get(m, "memory", "prefill_chunk", "int", lo=1),
        reserve_mib=c.get(m, "memory", "reserve_mib", "int", 0, lo=0),
        expert_cache_slots=c.get(m, "memory", "expert_cache_slots", "int", lo=0),
        total_experts=c.get(m, "memory", "total_experts", "int", lo=0),
        expert_bytes=c.get(m, "memory", "expert_bytes", "int", lo=0),
        expert_miss=c.get(m, "memory", "expert_miss", "str", "auto", choices=EXPERT_MISS),
        expert_lru_slots=c.get(m, "memory", "expert_lru_slots", "int", 0, lo=0),
        routing_profile=c.get(m, "memory", "routing_profile", "str"), budget=dict(budget))

    v = c.table(doc, "device")
    dev = DeviceSection(
        type=c.get(v, "device", "type", "str", "auto", choices=DEVICE_TYPES), name=c.get(v, "device", "name", "str"),
        total_mib=c.get(v, "device", "total_mib", "int", lo=0), free_mib=c.get(v, "device", "free_mib", "int", lo=0),
        capability=c.get(v, "device", "capability", "str"), dtype=c.get(v, "device", "dtype", "str", choices=DTYPES),
        vram_limit_mib=c.get(v, "device", "vram_limit_mib", "int", lo=1))
    cal = c.table(doc, "calibration")

    extra = {"": _unknown(doc, {"schema", "created_by", "target", "drafter", "speculative", "memory", "device",
                                "calibration"})}
    for name, table, sec in (("target", t, target), ("drafter", d, drafter), ("speculative", s, spec),
                             ("memory", m, mem), ("device", v, dev)):
        extra[name] = _unknown(table, {f.name for f in fields(sec)})
    return StrataConfig(target=target, drafter=drafter, speculative=spec, memory=mem, device=dev, calibration=cal,
                        schema=SCHEMA, created_by=c.get(doc, "", "created_by", "str"),
                        base=base if base is not None else Path.cwd(), extra={k: x for k, x in extra.items() if x})


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at `path`, or one sentence saying why it cannot be read."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"No config at {p}; run strata-setup to create one, or pass the right --config path.")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"The config {p} is not valid TOML ({exc}); fix it or rerun strata-setup.") from None
    except OSError as exc:
        raise ConfigError(f"The config {p} cannot be read ({exc.strerror or exc}); check its permissions.") from None


def load(path: Path, *, complete: bool = False) -> StrataConfig:
    """Read and check the config file at `path`; relative paths in it are relative to its folder."""
    p = Path(path).expanduser()
    return parse(read_toml(p), where=str(p), base=p.parent, complete=complete)
