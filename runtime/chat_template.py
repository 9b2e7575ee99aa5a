"""The model's chat template (from its folder), rendered as transformers' `apply_chat_template` renders it: Jinja2 in
an immutable sandbox (a template is code from a downloaded repo), `trim_blocks`/`lstrip_blocks`, loop controls, a
non-escaping `tojson`, `raise_exception`, `strftime_now`, and the special tokens (`bos_token`, `eos_token`, ...) as
variables. The rendered text is tokenized without adding special tokens: the template places them
(docs/commands.md, strata-serve)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from runtime.errors import UsageError

__all__ = ["ChatTemplate", "ChatTemplateError", "NoChatTemplateError", "load_chat_template",
           "require_chat_template"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(UsageError):
    """A chat the template cannot render (the template's own `raise_exception`, or a broken template)."""


class NoChatTemplateError(ChatTemplateError):
    """The model ships no chat template: chat needs one."""


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):   # a serialized AddedToken
        return v["content"]
    return None


def _read_json(p: Path) -> dict:
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{p} is not readable JSON ({e}); re-run strata-setup to fetch it again.") from e
    return doc if isinstance(doc, dict) else {}


def _pick(tpl: Any) -> str | None:
    """A template string, or the one named "default" from a list of named templates (as transformers picks)."""
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    return None


def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no way to CPython internals through it)."""
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace.")

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the type itself."""
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    return env


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = ""

    def __post_init__(self) -> None:
        import jinja2

        try:
            self._compiled = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template ({self.origin or 'given'}) is not valid Jinja: "
                                    f"{e}.") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` ([{role, content}, ...]); `kwargs` reach the template (enable_thinking)."""
        import jinja2

        data = {**self.special_tokens, **kwargs}
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **data)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template refused these messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the model's chat template failed on these messages ({type(e).__name__}: "
                                    f"{e}).") from e

    @staticmethod
    def encode(tokenizer: Any, text: str) -> list[int]:
        """Token ids of a rendered chat: no special tokens added (the template wrote them), as transformers does."""
        return tokenizer.encode(text, add_special_tokens=False).ids


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The template in `chat_template.jinja`, `tokenizer_config.json` ("chat_template") or `chat_template.json`,
    in that order (transformers saves the first today, the second before); None when the model has none."""
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    special = {k: t for k in _SPECIAL if (t := _token_text(cfg.get(k))) is not None}
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return ChatTemplate(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{jinja_file} is not readable ({e}).") from e
    if (src := _pick(cfg.get("chat_template"))) is not None:
        return ChatTemplate(src, special, str(cfg_path))
    json_file = folder / "chat_template.json"
    if json_file.is_file() and (src := _pick(_read_json(json_file).get("chat_template"))) is not None:
        return ChatTemplate(src, special, str(json_file))
    return None


def require_chat_template(folder: str | Path) -> ChatTemplate:
    tpl = load_chat_template(folder)
    if tpl is None:
        raise NoChatTemplateError(
            f"the model in {folder} has no chat template (no chat_template in its tokenizer_config.json), so it "
            f"cannot chat; send plain text to /v1/completions or use strata-run --prompt instead.")
    return tpl
