"""The checkpoint's chat template, rendered in a Jinja2 sandbox as transformers renders it, and what ends a
chat reply: the template's end-of-turn token and generation_config.json's eos ids."""

import json
import shutil

import pytest

from ouro_fast.model.chat_template import CHATML, ChatTemplate, ChatTemplateError
from ouro_fast.model.tokenizer import ASSETS_DIR, OuroTokenizer

CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "?"},
]
WITH_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are kind.<|im_end|>\\n' }}{% endif %}" + CHATML
)


def tokenizer_dir(tmp_path, template=None, jinja=None):
    """A copy of the shipped tokenizer files, with `template` in tokenizer_config.json and `jinja` as
    chat_template.jinja when given."""
    for f in ASSETS_DIR.iterdir():
        shutil.copy(f, tmp_path / f.name)
    if template is not None:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_chatml_conversation():
    text = ChatTemplate(CHATML).render(CHAT)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\n?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not ChatTemplate(CHATML).render(CHAT, add_generation_prompt=False).endswith("assistant\n")


def test_the_checkpoints_template_is_used(tmp_path):
    # A template with a default system prompt: a hard-coded ChatML would prompt the model differently.
    tok = OuroTokenizer.from_dir(tokenizer_dir(tmp_path, template=WITH_SYSTEM))
    assert tok.apply_chat_template(CHAT).startswith(
        "<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>user"
    )


def test_chat_template_jinja_wins_over_the_config_and_an_override_over_both(tmp_path):
    d = tokenizer_dir(tmp_path, template=WITH_SYSTEM, jinja="J{{ messages[0]['content'] }}")
    assert OuroTokenizer.from_dir(d).apply_chat_template(CHAT) == "JHi"
    assert OuroTokenizer.from_dir(d, "I{{ messages|length }}").apply_chat_template(CHAT) == "I3"
    f = tmp_path / "override.jinja"
    f.write_text("F{{ add_generation_prompt }}")
    assert OuroTokenizer.from_dir(d, str(f)).apply_chat_template(CHAT) == "FTrue"
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        OuroTokenizer.from_dir(d, "/no/such/template.jinja")


def test_named_templates_pick_the_default(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]
    assert OuroTokenizer.from_dir(tokenizer_dir(tmp_path, template=named)).apply_chat_template(CHAT) == (
        "D<|endoftext|>"
    )


def test_kwargs_and_continue_final_message():
    t = ChatTemplate("{% if enable_thinking %}<think>{% endif %}" + CHATML)
    assert t.render(CHAT, enable_thinking=True).startswith("<think><|im_start|>")
    assert not t.render(CHAT).startswith("<think>")
    partial = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    text = t.render(partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")  # no end of turn: the model continues it
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        t.render(partial, add_generation_prompt=True, continue_final_message=True)


def test_messages_are_checked_and_null_assistant_content_is_empty():
    t = ChatTemplate(CHATML)
    assert "assistant\n<|im_end|>" in t.render(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert t.render(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"
    for bad, why in (
        ([], "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        ([{"role": "user", "content": None}], "content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content\\[0\\] must be"),
    ):
        with pytest.raises(ChatTemplateError, match=why):
            t.render(bad)


def test_template_errors_are_client_errors_and_the_sandbox_holds():
    with pytest.raises(ChatTemplateError, match="only user turns"):
        ChatTemplate("{{ raise_exception('only user turns') }}").render(CHAT)
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(CHAT)
    with pytest.raises(ChatTemplateError, match="the chat template failed"):
        ChatTemplate("{{ messages[7]['content'] }}").render(CHAT)
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")
    assert ChatTemplate("{{ messages|tojson }}").render([{"role": "user", "content": "é<"}]) == (
        '[{"role": "user", "content": "é<"}]'
    )


def test_end_of_turn_is_the_token_after_an_assistant_message(tmp_path):
    tok = OuroTokenizer.from_dir(ASSETS_DIR)
    assert tok.chat_template.end_of_turn() == "<|im_end|>\n"
    assert tok.end_of_turn_ids() == (tok.token_to_id("<|im_end|>"),)
    plain = OuroTokenizer.from_dir(tokenizer_dir(tmp_path, template="{{ messages[-1]['content'] }}"))
    assert plain.end_of_turn_ids() == ()  # no special token closes a turn: nothing extra stops a reply


def test_bad_override_is_a_configuration_error():
    from ouro_fast.server.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match="OURO_FAST_CHAT_TEMPLATE"):
        ServerConfig.from_env({"OURO_FAST_CHAT_TEMPLATE": "{% for %}"})
    assert ServerConfig.from_env({"OURO_FAST_CHAT_TEMPLATE": "{{ 1 }}"}).chat_template == "{{ 1 }}"


# ---- stop tokens -------------------------------------------------------------------------------------


def _greedy(engine, prompt, n, **kw):
    from ouro_fast.engine.sampling import SamplingParams

    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, **kw))
    while True:
        for out in engine.step():
            if out.finished:
                return out


def test_generation_config_eos_ids_end_a_reply(model_dir, tmp_path):
    from ouro_fast.engine.engine import Engine, EngineConfig

    d = tmp_path / "ckpt"
    shutil.copytree(model_dir, d)
    prompt = [5, 6, 7, 8]
    free = _greedy(
        Engine(EngineConfig(model=str(d), device="cpu")), prompt, 8, ignore_eos=True
    ).request.output_ids
    stop = free[3]
    assert stop not in free[:3]
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, stop]  # a list, as some checkpoints write it
    (d / "generation_config.json").write_text(json.dumps(gen))
    engine = Engine(EngineConfig(model=str(d), device="cpu"))
    assert engine.eos_ids == {0, stop}
    out = _greedy(engine, prompt, 8)
    assert out.finish_reason == "stop" and out.request.output_ids == free[:4]
    # ignore_eos ignores every eos id, as vLLM does.
    assert _greedy(engine, prompt, 8, ignore_eos=True).request.output_ids == free
    gen["eos_token_id"] = "two"
    (d / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        Engine(EngineConfig(model=str(d), device="cpu"))
