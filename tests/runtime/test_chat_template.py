"""Chat templates render and tokenize exactly as transformers' apply_chat_template does, inside Jinja's sandbox."""

import json
import shutil
from pathlib import Path

import pytest

from runtime.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
    load_chat_template,
    require_chat_template,
)

NANO = Path(__file__).resolve().parents[2] / "setup_wizard" / "bundled" / "strata-nano"

# A Qwen3-style template: namespaces, reversed loops with loop controls, tojson, raise_exception, template kwargs.
QWEN_STYLE = (
    "{%- if tools %}{{- bos_token }}<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}</tools>\n{%- endif %}"
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' %}{% set ns.last_user = messages|length - 1 - loop.index0 %}"
    "{% break %}{% endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('roles must be system, user or "
    "assistant, not ' + m.role) }}{% endif %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in m.content %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}{%- else %}{%- set content = m.content %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{%- endif %}"
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "<think>\nsum</think>\n\n    return a + b"},
    {"role": "user", "content": "Now héllo — \"quoted\" <tags> & more"},
]


@pytest.fixture()
def folder(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(NANO / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((NANO / "tokenizer_config.json").read_text())
    cfg.update(chat_template=QWEN_STYLE, bos_token={"content": "<|mask|>", "__type": "AddedToken"})
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _reference(folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("gen", [True, False])
def test_render_and_ids_equal_transformers(folder, gen, kwargs):
    from tokenizers import Tokenizer

    ref = _reference(folder)
    tpl = load_chat_template(folder)
    tools = [{"type": "function", "function": {"name": "now", "description": "the time — <now>"}}]
    ours = tpl.render(CHAT, add_generation_prompt=gen, tools=tools, **kwargs)
    theirs = ref.apply_chat_template(CHAT, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs)
    assert ours == theirs
    assert "<|mask|><tools>" in ours and "héllo" in ours and "sum</think>" not in ours
    ids = tpl.encode(Tokenizer.from_file(str(folder / "tokenizer.json")), ours)
    ref_ids = ref.apply_chat_template(CHAT, tools=tools, add_generation_prompt=gen, tokenize=True,
                                      return_dict=False, **kwargs)
    assert ids == list(ref_ids)


def test_raise_exception_is_one_sentence(folder):
    tpl = load_chat_template(folder)
    with pytest.raises(ChatTemplateError, match="refused these messages: roles must be system, user or assistant, "
                                                "not tool"):
        tpl.render([{"role": "tool", "content": "x"}])


def test_the_sandbox_holds():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate(evil).render([])
    with pytest.raises(ChatTemplateError, match="namespace"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_sources_and_missing(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_chat_template(tmp_path) is None
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        require_chat_template(tmp_path)
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ eos_token }}D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": named}))
    assert load_chat_template(tmp_path).render([]) == "</s>D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages|length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "a"}]) == "J1"
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="not readable JSON"):
        load_chat_template(tmp_path)


def test_generation_tag_renders_its_body():
    tpl = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
    assert tpl.render([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"
