"""Multi-turn tool-use rollouts for RL (rl/agent.py): token ids built by concatenation equal the rendered
conversation, the loss mask covers exactly the model's own tokens, the agent reward of scripted trajectories
computed by hand, the ways a trajectory ends, batches against one trajectory at a time, log-probs against a
fresh forward pass, and the tiny tool run (tests/tool_run.py) rolled out with the real calculator.

The scripted model is a real GPT whose logits are pushed towards a script at every position: reply k of a
prompt's script is pushed token by token after the trajectory's k-th generation prompt, so it follows the
script through the real batched decoder across rounds, and a fresh forward over the finished ids sees the
same pushes (for the log-prob check)."""
from __future__ import annotations

import pytest
import torch

from nanoforge.core.config import ModelConfig
from nanoforge.core.errors import NanoforgeError
from nanoforge.infer.generate import SamplingConfig
from nanoforge.infer.turns import converse
from nanoforge.chat.tools import tool_schemas
from nanoforge.weights.load import load_model
from nanoforge.model.gpt import GPT
from nanoforge.rl.agent import Trajectory, agent_prompt, sample_trajectories, environment_ids
from nanoforge.rl.prompts import PromptRecord, prompt_record
from nanoforge.rl.rewards import answer_found
from nanoforge.chat.calculator import evaluate
from tool_run import QUESTIONS, conversation

TOOLS = ["calculator"]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
ANSWER = "The answer is 84."
GREEDY = SamplingConfig(temperature=0, max_new_tokens=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread


class ScriptedAgentGPT(GPT):
    """A real GPT pushed towards scripted replies. `scripts` maps a prompt (token ids) to its replies (token id
    lists); `turn_start` is the generation prompt's tokens, after each of which the next reply begins. A
    reply position without a script gets the model's own logits, with the `unstoppable` tokens pushed down
    (so that the random model's free text runs to max_new_tokens instead of stopping wherever it likes)."""

    def __init__(self, cfg: ModelConfig, scripts: dict[tuple, list[list[int]]], turn_start: list[int],
                 unstoppable: list[int]):
        super().__init__(cfg)
        self.scripts, self.turn_start, self.unstoppable = scripts, list(turn_start), list(unstoppable)

    def forward(self, input_ids, cache=None, layout=None, keep=None):
        if layout is not None:  # the log-probs of finished rollouts (model/prefix.py): the model's own, unscripted
            return super().forward(input_ids, layout=layout, keep=keep)
        if cache is None:  # a fresh forward over one finished row: (1, T, V)
            ids = input_ids[0].tolist()
            return self._push(super().forward(input_ids)[0], [ids[:t + 1] for t in range(len(ids))])[None]
        histories = self._histories(cache)  # the tokens up to each position of the step, (N,) lists
        logits = super().forward(input_ids, cache=cache, keep=keep)  # (K, V) at the kept positions
        return self._push(logits, [h for h, k in zip(histories, keep.tolist()) if k])

    def _push(self, logits, histories):
        for row, history in enumerate(histories):
            target, started = self._next(history)
            if target is not None:
                logits[row, target] += 1e4
            elif started:
                logits[row, self.unstoppable] -= 1e4
        return logits

    @staticmethod
    def _histories(step) -> list[list[int]]:
        """For each token of an engine step (model/slots.py SlotStep), its sequence's tokens up to and including
        it: decode slots first, then each prefill chunk, as the step lays them out."""
        out = [seq.tokens[:seq.fed + 1] for seq in step.owners[:len(step.decode)]]
        for seq, (_, n) in zip(step.owners[len(step.decode):], step.prefill):
            out += [seq.tokens[:seq.fed + t + 1] for t in range(n)]
        return out

    def _next(self, ids: list[int]) -> tuple[int | None, bool]:
        """The scripted token after `ids` (None: the model's own), and whether a reply has begun."""
        n = len(self.turn_start)
        starts = [i + 1 for i in range(n - 1, len(ids)) if ids[i + 1 - n:i + 1] == self.turn_start]
        replies = next((r for p, r in self.scripts.items() if tuple(ids[:len(p)]) == p), None)
        turn = len(starts) - 1
        if replies is None or not 0 <= turn < len(replies):
            return None, bool(starts)
        step = len(ids) - starts[-1]
        return (replies[turn][step] if step < len(replies[turn]) else None), True


def scripted_model(tokenizer, scripts, think=False, max_seq_len=1024, seed=0) -> ScriptedAgentGPT:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      max_seq_len=max_seq_len, tie_embeddings=False, init_std=0.1)
    return ScriptedAgentGPT(cfg, scripts, generation_prompt(tokenizer, think), tokenizer.stop_ids).eval()


def generation_prompt(tokenizer, think: bool) -> list[int]:
    """The tokens from the last <|im_start|> of a render with the generation prompt: `<|im_start|>assistant\\n`
    and the think opening."""
    ids, _ = tokenizer.render_chat([{"role": "user", "content": "?"}], add_generation_prompt=True,
                                   open_thinking=think)
    return ids[len(ids) - 1 - ids[::-1].index(tokenizer.im_start_id):]


def record(text: str, gt) -> PromptRecord:
    return PromptRecord(messages=[{"role": "user", "content": text}], gt=gt, source=f"test:{text}")


def reply(tokenizer, text: str, stop=True) -> list[int]:
    return tokenizer.encode(text) + ([tokenizer.im_end_id] if stop else [])


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """The (start, end) spans of consecutive 1s."""
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


# ---------------------------------------------------------------------------------------------- the scripted case


@pytest.mark.parametrize("think", [False, True])
def test_call_then_answer_equals_the_rendered_conversation(tiny_tokenizer, think):
    tok = tiny_tokenizer
    rec = record("What is 12*7?", ["84"])
    prompt = agent_prompt(tok, rec, TOOLS, think)
    reasoning = ("I should compute 12*7.", "The calculator gave 84.")
    first = (reasoning[0] + "\n</think>\n\n" if think else "") + CALL
    second = (reasoning[1] + "\n</think>\n\n" if think else "") + ANSWER
    replies = [reply(tok, first), reply(tok, second)]
    model = scripted_model(tok, {tuple(prompt): replies}, think)
    cfg = SamplingConfig(temperature=0, max_new_tokens=96)
    [trajectory] = sample_trajectories(model, tok, [prompt], [rec], TOOLS, cfg, max_turns=4, think=think)

    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*7"}}}
    conversation = [*rec.messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "84"}, {"role": "assistant", "content": ANSWER}]
    if think:
        conversation[1]["reasoning_content"], conversation[3]["reasoning_content"] = reasoning
    rendered, rendered_mask = tok.render_chat(conversation, tools=tool_schemas(TOOLS))
    assert trajectory.ids == rendered[:-1]  # the render's closing '\n' after the last <|im_end|> is not sampled
    environment = environment_ids(tok, [{"role": "tool", "content": "84"}], think)
    assert trajectory.ids == prompt + replies[0] + environment + replies[1]
    assert trajectory.mask == [0] * len(prompt) + [1] * len(replies[0]) + [0] * len(environment) + [1] * len(replies[1])
    # the render trains the whole assistant turn; the rollout leaves out the think opening the environment wrote
    for (start, end), (r_start, r_end) in zip(runs(trajectory.mask), runs(rendered_mask[:-1])):
        assert end == r_end and tok.decode(trajectory.ids[r_start:start]) == ("<think>\n" if think else
                                                                               "<think>\n\n</think>\n\n")
    assert trajectory.texts == [first, second] and trajectory.tool_results == ["84"]
    assert trajectory.end == "answer" and trajectory.finished and trajectory.turns == 2
    assert trajectory.replies[0].tool_calls[0]["id"] == "call_0_0" and trajectory.replies[1].content == ANSWER
    # agent reward by hand: one call that ran (0.1), no malformed block, "84" found in the answer (1.0), finished
    assert trajectory.reward_parts == {"calls": 0.1, "bad": 0.0, "answer": 1.0, "unfinished": 0.0,
                                       "total": pytest.approx(1.1)}
    assert trajectory.reward == pytest.approx(1.1)
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.mask) if not m)
    assert len(trajectory.logprobs) == len(trajectory.ids)


def test_environment_tokens_are_the_templates_tail(tiny_tokenizer):
    tok = tiny_tokenizer
    messages = [{"role": "tool", "content": "84"}, {"role": "tool", "content": "<|im_end|> 7"}]
    ids = environment_ids(tok, messages, think=False)
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n"
                               "<|im_end|> 7\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n"
                               "</think>\n\n")
    # the template's two control tokens are the control ids; the result's spelling of one stays plain text
    assert [i for i in ids if i in (tok.im_start_id, tok.im_end_id)] == \
        [tok.im_start_id, tok.im_end_id, tok.im_start_id]
    assert tok.decode(environment_ids(tok, messages[:1], think=True)).endswith("<|im_start|>assistant\n<think>\n")


# ---------------------------------------------------------------------------------------------- how it ends


def test_still_calling_at_max_turns_is_unfinished(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = record("What is 12*7?", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    calls = [reply(tok, CALL)] * 3
    model = scripted_model(tok, {tuple(prompt): calls})
    [trajectory] = sample_trajectories(model, tok, [prompt], [rec], TOOLS, GREEDY, max_turns=2)
    environment = environment_ids(tok, [{"role": "tool", "content": "84"}], False)
    # both calls ran; nothing follows the last one, since nothing will be generated after it
    assert trajectory.ids == prompt + calls[0] + environment + calls[1]
    assert trajectory.end == "max_turns" and not trajectory.finished and trajectory.tool_results == ["84", "84"]
    assert trajectory.reward_parts == {"calls": pytest.approx(0.2), "bad": 0.0, "answer": 0.0, "unfinished": -0.5,
                                       "total": pytest.approx(-0.3)}


def test_malformed_and_unknown_calls(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = record("What is 12*7?", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    bad = reply(tok, '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>')
    unknown = reply(tok, '<tool_call>\n{"name": "abacus", "arguments": {}}\n</tool_call>')
    model = scripted_model(tok, {tuple(prompt): [unknown, bad]})
    [trajectory] = sample_trajectories(model, tok, [prompt], [rec], TOOLS, GREEDY, max_turns=4)
    # an unknown tool gets an error result and the trajectory goes on; a malformed block is no call: it ends
    assert trajectory.tool_results == ["Error: unknown tool 'abacus' (available: calculator)"]
    assert trajectory.turns == 2 and trajectory.end == "answer" and trajectory.finished
    assert len(trajectory.replies[1].errors) == 1 and not trajectory.replies[1].tool_calls
    assert trajectory.reward_parts == {"calls": 0.0, "bad": -0.2, "answer": 0.0, "unfinished": 0.0,
                                       "total": pytest.approx(-0.2)}


def test_truncated_reply_ends_unfinished_without_its_calls(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = record("What is 12*7?", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    long = reply(tok, CALL + " and then some more words after the call")
    cfg = SamplingConfig(temperature=0, max_new_tokens=len(long) - 3)
    model = scripted_model(tok, {tuple(prompt): [long]})
    [trajectory] = sample_trajectories(model, tok, [prompt], [rec], TOOLS, cfg, max_turns=4)
    assert trajectory.ids == prompt + long[:cfg.max_new_tokens]  # no stop token: it was cut
    assert trajectory.mask == [0] * len(prompt) + [1] * cfg.max_new_tokens
    assert trajectory.end == "length" and not trajectory.finished and trajectory.tool_results == []
    assert trajectory.reward == pytest.approx(-0.5)


def test_next_round_that_would_not_fit_ends_the_trajectory(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = record("What is 12*7?", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    replies = [reply(tok, CALL), reply(tok, ANSWER)]
    environment = environment_ids(tok, [{"role": "tool", "content": "84"}], False)
    needed = len(prompt) + len(replies[0]) + len(environment) + GREEDY.max_new_tokens
    for context, end in ((needed, "answer"), (needed - 1, "context")):
        model = scripted_model(tok, {tuple(prompt): replies}, max_seq_len=context)
        [trajectory] = sample_trajectories(model, tok, [prompt], [rec], TOOLS, GREEDY, max_turns=4)
        assert trajectory.end == end and trajectory.turns == (2 if end == "answer" else 1)
    assert trajectory.ids == prompt + replies[0] and trajectory.tool_results == ["84"]
    assert trajectory.reward == pytest.approx(0.1 - 0.5)
    small = scripted_model(tok, {}, max_seq_len=len(prompt) + GREEDY.max_new_tokens - 1)
    [never] = sample_trajectories(small, tok, [prompt], [rec], TOOLS, GREEDY, max_turns=4)
    assert never.end == "context" and never.turns == 0 and never.ids == prompt and sum(never.mask) == 0


# ---------------------------------------------------------------------------------------------- batches, log-probs


def _mixed_batch(tok):
    """Four prompts of different lengths: call then answer, answer at once, two calls then an answer, and one
    with no script (the random model's own greedy text until max_new_tokens)."""
    questions = ["What is 12*7?", "Hi", "What is 3+4 and then 12*7, please?", "Say something"]
    records = [record(q, "84") for q in questions]
    prompts = [agent_prompt(tok, r, TOOLS, False) for r in records]
    call_34 = reply(tok, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>')
    scripts = {tuple(prompts[0]): [reply(tok, CALL), reply(tok, ANSWER)],
               tuple(prompts[1]): [reply(tok, "Hello!")],
               tuple(prompts[2]): [call_34, reply(tok, CALL), reply(tok, "7 and 84")]}
    return prompts, records, scripts


def test_batch_equals_one_trajectory_at_a_time(tiny_tokenizer):
    tok = tiny_tokenizer
    prompts, records, scripts = _mixed_batch(tok)
    model = scripted_model(tok, scripts)
    batched = sample_trajectories(model, tok, prompts, records, TOOLS, GREEDY, max_turns=4)
    alone = [sample_trajectories(model, tok, [p], [r], TOOLS, GREEDY, max_turns=4)[0] for p, r in zip(prompts, records)]
    assert [t.end for t in batched] == ["answer", "answer", "answer", "length"]
    assert [t.turns for t in batched] == [2, 1, 3, 1] and batched[2].tool_results == ["7", "84"]
    for b, a in zip(batched, alone):
        assert b.ids == a.ids and b.mask == a.mask and b.texts == a.texts and b.reward == a.reward
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert len(set(batched[3].ids[len(prompts[3]):])) > 3, "the unscripted row must generate varied text"


def test_logprobs_equal_a_fresh_forward_at_the_sampling_temperature(tiny_tokenizer):
    tok = tiny_tokenizer
    prompts, records, scripts = _mixed_batch(tok)
    scripts[tuple(prompts[0])] = scripts[tuple(prompts[0])][:1]  # the answer after the call is sampled freely
    model = scripted_model(tok, scripts)
    cfg = SamplingConfig(temperature=0.7, max_new_tokens=64)
    trajectories = sample_trajectories(model, tok, prompts, records, TOOLS, cfg, max_turns=3,
                                  generator=torch.Generator().manual_seed(5))
    assert trajectories[0].turns == 2 and trajectories[0].tool_results == ["84"]
    for t in trajectories:
        with torch.no_grad():
            logits = model(torch.tensor([t.ids]))[0].float()  # (T, V)
        fresh = torch.log_softmax(logits / cfg.temperature, dim=-1)
        expected = [fresh[j - 1, t.ids[j]].item() if m else 0.0 for j, m in enumerate(t.mask)]
        assert t.logprobs == pytest.approx(expected, abs=1e-4)
    free = [lp for lp, m in zip(trajectories[3].logprobs, trajectories[3].mask) if m]
    assert min(free) < -0.5, "the unscripted row's log-probs must be non-trivial for the check to mean anything"
    again = sample_trajectories(model, tok, prompts, records, TOOLS, cfg, max_turns=3,
                           generator=torch.Generator().manual_seed(5))
    assert [t.ids for t in again] == [t.ids for t in trajectories]


def test_bad_arguments_are_refused(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = record("Hi", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    model = scripted_model(tok, {}, max_seq_len=256)
    with pytest.raises(NanoforgeError, match="max-turns"):
        sample_trajectories(model, tok, [prompt], [rec], TOOLS, GREEDY, max_turns=0)
    with pytest.raises(NanoforgeError, match="abacus"):
        sample_trajectories(model, tok, [prompt], [rec], ["abacus"], GREEDY, max_turns=1)
    with pytest.raises(NanoforgeError, match="one record per prompt"):
        sample_trajectories(model, tok, [prompt, prompt], [rec], TOOLS, GREEDY, max_turns=1)
    with pytest.raises(NanoforgeError, match="repetition_penalty"):
        sample_trajectories(model, tok, [prompt], [rec], TOOLS, SamplingConfig(repetition_penalty=1.2), max_turns=1)
    with pytest.raises(NanoforgeError, match='"gt"'):
        sample_trajectories(model, tok, [prompt], [record("Hi", None)], TOOLS, GREEDY, max_turns=1)


# ---------------------------------------------------------------------------------------------- the tool run


@pytest.mark.slow
@pytest.mark.parametrize("think", [False, True])
def test_tool_run_rollouts_with_the_calculator(tool_run_dir, think):
    model, tok, _ = load_model(tool_run_dir, "cpu")
    # the tool run's own prompts (system turn with the calculator declared, then the question), with "gt"
    records = [prompt_record({"conversations": conversation(*q, think=think)[:2],
                              "gt": evaluate(f"{q[0]} {q[1]} {q[2]}")}) for q in QUESTIONS]
    prompts = [agent_prompt(tok, r, TOOLS, think) for r in records]
    cfg = SamplingConfig(temperature=0, max_new_tokens=64)
    trajectories = sample_trajectories(model, tok, prompts, records, TOOLS, cfg, max_turns=3, think=think)
    response = (tok.token_to_id("<tool_response>"), tok.token_to_id("</tool_response>"))
    for t, p in zip(trajectories, prompts):
        assert isinstance(t, Trajectory) and t.ids[:len(p)] == p and t.turns >= 1
        assert len(t.ids) == len(t.mask) == len(t.logprobs)
        # every masked run is one reply as generated, closed by <|im_end|> when it stopped
        spans = runs(t.mask)
        assert len(spans) == t.turns
        for (start, end), text in zip(spans, t.texts):
            stopped = t.ids[end - 1] == tok.im_end_id
            assert tok.decode(t.ids[start:end - stopped]) == text
        # nothing inside a <tool_response> block is trained
        inside = False
        for token, m in zip(t.ids, t.mask):
            inside = (inside or token == response[0]) and token != response[1]
            assert not (inside and m)
        unanswered = len(t.replies[-1].tool_calls) if t.end in ("max_turns", "context") else 0
        assert t.ids.count(response[0]) == len(t.tool_results) - unanswered
    # the tool run calls the calculator, then answers (a tiny model: not always right)
    assert sum(t.end == "answer" and t.turns == 2 and len(t.tool_results) == 1 for t in trajectories) >= 9
    # the answer term is whether the calculator's result appears in the last reply (the model's own answer,
    # right or not: its accuracy depends on the tokenizer the fixture trained, with or without ../shared)
    for t, r in zip(trajectories, records):
        last = t.replies[-1].content if t.replies else ""
        assert t.reward_parts["answer"] == (1.0 if answer_found(last, r.gt[0]) else 0.0)
    # the eval runs the same conversations through the same loop (infer/turns.py): the same tokens
    loops, _ = converse(model, tok, [r.messages for r in records], cfg, 4, tools=TOOLS, think=think, max_turns=3)
    for t, loop in zip(trajectories, loops):
        assert loop.ids == t.ids and loop.texts == t.texts and loop.end == t.end
        if t.end == "answer":
            assert t.ids == tok.render_chat(loop.messages)[0][:-1]
