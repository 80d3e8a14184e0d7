"""`{% generation %}` markers: our templates carry them, so transformers' assistant mask (what TRL's
assistant_only_loss trains on) equals our loss mask token by token; templates that carry them load and render
here exactly as without them."""
from __future__ import annotations

import pytest

from nanoforge.chat.template import CHAT_TEMPLATE, THINKING_TOOLS_TEMPLATE, without_generation_markers
from nanoforge.chat.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
PLAIN = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"},
         {"role": "assistant", "content": "Hello, friend."}, {"role": "user", "content": "again"},
         {"role": "assistant", "content": "Hello again."}]
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
             {"role": "assistant", "content": None, "reasoning_content": "I add.",
              "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
             {"role": "tool", "content": "3"}, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n3."}]
CASES = [(CHAT_TEMPLATE, PLAIN, None), (CHAT_TEMPLATE, MULTI, None), (THINKING_TOOLS_TEMPLATE, MULTI, None),
         (THINKING_TOOLS_TEMPLATE, TOOL_CHAT, TOOLS), (THINKING_TOOLS_TEMPLATE, TOOL_CHAT, None)]


@pytest.mark.parametrize("template,messages,tools", CASES)
def test_transformers_assistant_mask_equals_our_loss_mask(template, messages, tools, tiny_tokenizer, tmp_path):
    ours = Tokenizer(tiny_tokenizer.backend, chat_template=template, config=tiny_tokenizer.config)
    ours.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids, mask = ours.render_chat(messages, tools=tools)
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == ids
    assert list(out["assistant_masks"]) == mask and sum(mask) > 0


@pytest.mark.parametrize("template,messages,tools", CASES)
def test_marked_template_renders_as_unmarked(template, messages, tools, tiny_tokenizer):
    unmarked = without_generation_markers(template)
    assert unmarked != template and "endgeneration" not in unmarked
    marked = Tokenizer(tiny_tokenizer.backend, chat_template=template)
    plain = Tokenizer(tiny_tokenizer.backend, chat_template=unmarked)
    for prompt in (False, True):
        assert marked.render_text(messages, prompt, tools) == plain.render_text(messages, prompt, tools)
    assert marked.render_chat(messages, tools=tools) == plain.render_chat(messages, tools=tools)


def test_foreign_marked_template_loads(tiny_tokenizer):
    # the spacing and scoping HF's own marked templates use: a `set` inside the block stays inside
    template = ("{% set tail = '' %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                "{% generation %}{% set tail = '!' %}{{ m.content }}<|im_end|>{% endgeneration %}"
                "{% else %}{{ m.content }}<|im_end|>{% endif %}{{ tail }}\n{% endfor %}")
    tok = Tokenizer(tiny_tokenizer.backend, chat_template=template)
    assert tok.render_text(PLAIN) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
