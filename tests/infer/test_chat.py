"""The terminal chat on a real (tiny, briefly trained) run: one-shot piped input, multi-turn history, the
commands, fitting a long conversation into the context, and `echo hi | nanoforge chat RUN`."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.chat import chat_loop
from nanoforge.infer.generate import SamplingConfig

from test_generate import make_tiny_run

ROOT = Path(__file__).resolve().parents[2]
CFG = SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, max_new_tokens=12, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer):
    return make_tiny_run(tmp_path_factory, tiny_tokenizer)


@pytest.fixture(scope="module")
def loaded(run_dir):
    from nanoforge.weights.load import load_model

    model, tokenizer, _ = load_model(run_dir)
    return model, tokenizer


def chat(loaded, text: str, interactive: bool = True, system: str | None = None, cfg: SamplingConfig = CFG):
    """Run chat_loop on `text` as input; (output, messages at the end, rendered prompt ids of each reply)."""
    model, tokenizer = loaded
    out, prompts = io.StringIO(), []
    messages = chat_loop(model, tokenizer, cfg, system, io.StringIO(text), out, interactive,
                         on_prompt=prompts.append)
    return out.getvalue(), messages, prompts


def rendered(tokenizer, messages):
    return tokenizer.render_chat(messages, add_generation_prompt=True)[0]


def test_piped_input_is_one_message_with_one_reply(loaded):
    output, messages, prompts = chat(loaded, "hello there\n/reset\nsecond line\n", interactive=False)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "hello there\n/reset\nsecond line", "all of stdin, commands included"
    assert output == messages[1]["content"] + "\n", "just the reply: no prompts, prefixes or banners"
    assert prompts == [rendered(loaded[1], messages[:1])]


def test_piped_input_that_is_empty_or_too_long_is_an_error(loaded):
    with pytest.raises(NanoforgeError, match="no message"):
        chat(loaded, "  \n", interactive=False)
    with pytest.raises(NanoforgeError, match="shorter"):
        chat(loaded, "story " * 200, interactive=False)


def test_second_turn_sees_the_first_turn_and_its_reply(loaded):
    tokenizer = loaded[1]
    output, messages, prompts = chat(loaded, "hello\nhow are you?\n", system="You are kind.")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert prompts[0] == rendered(tokenizer, messages[:2])
    assert prompts[1] == rendered(tokenizer, messages[:4]), "turn 2's prompt holds turn 1 and its reply"
    assert output.count("you> ") == 3 and output.count("bot> ") == 2
    for reply in (messages[2]["content"], messages[4]["content"]):
        assert f"bot> {reply}\n" in output, "the reply printed is the reply kept in the history"
    assert chat(loaded, "hello\nhow are you?\n", system="You are kind.")[0] == output, "seeded: reproducible"


def test_reset_forgets_the_conversation_but_keeps_the_system_prompt(loaded):
    tokenizer = loaded[1]
    output, messages, prompts = chat(loaded, "first\n/reset\nsecond\n", system="Be brief.")
    assert prompts[1] == rendered(tokenizer, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "second"}])
    assert "(conversation cleared)" in output


def test_system_command_sets_the_prompt_and_starts_over(loaded):
    tokenizer = loaded[1]
    _, _, prompts = chat(loaded, "first\n/system Answer in French.\nsecond\n/system\nthird\n")
    assert prompts[1] == rendered(tokenizer, [{"role": "system", "content": "Answer in French."},
                                              {"role": "user", "content": "second"}])
    assert prompts[2] == rendered(tokenizer, [{"role": "user", "content": "third"}]), "/system alone removes it"


def test_exit_eof_and_ctrl_c_end_the_chat(loaded):
    output, messages, prompts = chat(loaded, "first\n/exit\nnever read\n")
    assert len(prompts) == 1 and output.endswith("you> ")
    _, _, prompts = chat(loaded, "first\n")  # end of input after one turn
    assert len(prompts) == 1

    class CtrlC(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    model, tokenizer = loaded
    out = io.StringIO()
    assert chat_loop(model, tokenizer, CFG, None, CtrlC(), out, interactive=True) == []
    assert out.getvalue().endswith("you> \n")


def test_help_and_unknown_commands(loaded):
    output, messages, prompts = chat(loaded, "/help\n/frobnicate\n\n")
    assert "/reset" in output and "/system TEXT" in output and "/exit" in output
    assert "unknown command /frobnicate" in output
    assert messages == [] and prompts == []


def test_long_conversation_drops_the_oldest_turns(loaded):
    model, tokenizer = loaded
    context = model.model.rotary_emb.n_positions  # 128 in the tiny preset
    cfg = SamplingConfig(temperature=0, repetition_penalty=1.3, max_new_tokens=1000)  # room capped at 64
    budget = context - context // 2
    turns = [f"message number {i} about the little robot" for i in range(6)]
    output, messages, prompts = chat(loaded, "\n".join(turns) + "\n", system="Be kind.", cfg=cfg)
    assert output.count("dropping the oldest turns") == 1, "said once"
    assert len(prompts) == 6 and all(len(p) <= budget for p in prompts)
    assert messages[0] == {"role": "system", "content": "Be kind."}
    assert messages[-2] == {"role": "user", "content": turns[-1]}
    assert messages[1]["content"] != turns[0], "the oldest pair is gone"
    assert prompts[-1] == rendered(tokenizer, messages[:-1])


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(loaded):
    output, messages, prompts = chat(loaded, "hello\n" + "story " * 200 + "\nshort one\n")
    assert "send a shorter one" in output and "dropping" not in output
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello", "short one"]
    assert prompts[1] == rendered(loaded[1], messages[:3]), "the history before the long message is kept"


def test_ctrl_c_during_a_reply_stops_only_the_reply(loaded, monkeypatch):
    from nanoforge.infer.engine import Engine

    real_step, calls = Engine.step, []

    def ctrl_c_in_the_third_step(engine):  # the real generation, cut by a Ctrl-C in reply 1
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(engine)

    monkeypatch.setattr(Engine, "step", ctrl_c_in_the_third_step)
    model, tokenizer = loaded
    out = io.StringIO()
    cfg = SamplingConfig(temperature=0, max_new_tokens=12)
    messages = chat_loop(model, tokenizer, cfg, None, io.StringIO("first\nsecond\n"), out, interactive=True)
    assert re.search(r"bot> [^\n]* \(interrupted\)\n", out.getvalue()), out.getvalue()
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"], "the chat went on"


def test_run_chat_answers_piped_input(run_dir):
    code = f"from nanoforge.infer.chat import run_chat; run_chat({str(run_dir)!r}, max_new_tokens=8, seed=0)"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], input="hi\n", capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and "you>" not in result.stdout and result.stderr == ""


def _chat_is_wired() -> bool:
    from nanoforge.cli import build_parser

    parser = build_parser()
    commands = next((a.choices for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)), {})
    return "chat" in commands


@pytest.mark.slow
def test_piped_chat_from_the_command_line(run_dir):
    if not _chat_is_wired():
        pytest.skip("cli not wired yet")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "nanoforge", "chat", str(run_dir), "--max-new-tokens", "8",
                             "--seed", "0"], input="hi\n", capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and "you>" not in result.stdout and "bot>" not in result.stdout


def test_generate_continues_plain_text_with_the_model_and_no_template(run_dir, loaded):
    """`nanoforge generate`: the prompt, then exactly what greedy decoding of the plain prompt gives (no chat
    template around it); seeded samples repeat; an empty prompt starts a new document."""
    from nanoforge.infer.chat import run_generate
    from nanoforge.infer.generate import complete

    model, tokenizer = loaded
    out = io.StringIO()
    run_generate(run_dir, prompt="Once upon a time", temperature=0.0, repetition_penalty=1.0, max_new_tokens=10,
                 device="cpu", out=out)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=10)
    expected = complete(model, tokenizer, [tokenizer.encode("Once upon a time")], greedy,
                        stop_ids=[tokenizer.eos_id, tokenizer.im_start_id])[0].text
    assert out.getvalue() == "Once upon a time" + expected + "\n"
    assert "<|im_start|>" not in out.getvalue()

    def sampled(seed, n=2):
        buf = io.StringIO()
        run_generate(run_dir, prompt="The", num_samples=n, max_new_tokens=8, seed=seed, device="cpu", out=buf)
        return buf.getvalue()
    two = sampled(5)
    assert two == sampled(5) and two.count("--- sample ") == 2 and two.startswith("--- sample 1 of 2\nThe")
    buf = io.StringIO()
    run_generate(run_dir, input_stream=io.StringIO(""), max_new_tokens=6, seed=0, device="cpu", out=buf)
    assert buf.getvalue().endswith("\n")  # from <|endoftext|>: something, or nothing if it stops at once


def test_generate_keeps_the_end_of_a_prompt_longer_than_the_context(run_dir, loaded, capsys):
    from nanoforge.infer.chat import run_generate
    model, tokenizer = loaded
    long_prompt = "the cat sat on the mat. " * 200
    assert len(tokenizer.encode(long_prompt)) > model.cfg.max_seq_len
    out = io.StringIO()
    run_generate(run_dir, prompt=long_prompt, max_new_tokens=4, seed=0, device="cpu", out=out)
    assert out.getvalue().startswith(long_prompt)
    assert f"continues from the last {model.cfg.max_seq_len - 1}" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_from_the_command_line_reads_stdin(run_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "nanoforge", "generate", str(run_dir), "--max-new-tokens", "6", "--seed", "0"]
    result = subprocess.run(cmd, input="Once upon", capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon") and result.stdout.endswith("\n")
    missing = subprocess.run(cmd[:4] + ["/nonexistent/run", "--prompt", "x"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert missing.returncode == 1 and "/nonexistent/run" in missing.stderr
