"""`nanoforge grpo --tools calculator --max-turns N`: a scripted step's rollout batch (ids, loss mask, rewards,
advantages) against a hand-built expectation, old log-probs that make the first ratio exactly 1, a run with
the tiny tool run (tests/tool_run.py) that logs the agent's figures, exact resume, and bad inputs."""
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import metrics_of
from nanoforge.core.errors import NanoforgeError
from nanoforge.rl.agent import agent_prompt, agent_rollout, environment_ids, pack_trajectories, Trajectory
from nanoforge.recipes.grpo import RLOptions, grpo
from nanoforge.rl.losses import policy_loss
from nanoforge.rl.prompts import PromptIterator
from nanoforge.model.prefix import prefix_token_logps
from nanoforge.rl.grpo_batches import RolloutBatches, policy_objective
from nanoforge.chat.calculator import evaluate
from nanoforge.weights import checkpoint as ckpt
from test_agent import CALL, TOOLS, record, reply, scripted_model
from tool_run import QUESTIONS, question

ROOT = Path(__file__).resolve().parents[2]
FAST = {"precision": "fp32", "tensorboard": False, "save_every": 0, "device": "cpu"}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode on one thread


# ---------------------------------------------------------------------------------------------- the scripted case


def test_pack_shifts_the_trajectory_mask_onto_targets():
    a = Trajectory(ids=[1, 2, 3, 4, 5], mask=[0, 0, 1, 1, 0], logprobs=[0.0] * 5, prompt_len=2)
    b = Trajectory(ids=[1, 2, 7], mask=[0, 0, 0], logprobs=[0.0] * 3, prompt_len=3)  # nothing sampled
    ids, mask = pack_trajectories([a, b], pad_id=9)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 7, 9, 9]]
    assert mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]


def test_a_scripted_step_equals_the_hand_built_batch(tiny_tokenizer):
    """Two prompts x 2 trajectories, --max-turns 2: "12*7" calls the calculator, then answers 84 (reward 0.1 for
    the call + 1.0 for "gt" found); "keep calling" calls twice and runs out of turns (0.2 - 0.5 unfinished).
    The scripted model's pushes make sampling at temperature 0.8 follow the script, so the step's batch is
    known token for token. grad_accum 2: each micro-batch is one prompt's pair of trajectories. The step's batch
    source is built as grpo() builds it (RolloutBatches over agent_rollout), with the scripted model as policy
    and reference, since grpo() loads its own model from --init."""
    tok = tiny_tokenizer
    answer_rec, looping_rec = record("What is 12*7?", "84"), record("Keep calling", "84")
    answer_prompt, looping_prompt = (agent_prompt(tok, r, TOOLS, False) for r in (answer_rec, looping_rec))
    call, answer = reply(tok, CALL), reply(tok, "The answer is 84.")
    model = scripted_model(tok, {tuple(answer_prompt): [call, answer], tuple(looping_prompt): [call, call, call]})
    cfg = RLOptions(num_generations=2, temperature=0.8, max_new_tokens=64, advantage="zscore")
    records = [answer_rec, looping_rec]
    batches = RolloutBatches(model, tok, PromptIterator(records, 2, seed=0), cfg, None, seed=0, grad_accum=2,
                             reference=model, rollout_fn=partial(agent_rollout, tools=TOOLS, max_turns=2))
    first, second = batches.next_batch(), batches.next_batch()
    batch = {k: torch.cat([first[k], second[k]]) if first[k].dim() else first[k] for k in first}

    environment = environment_ids(tok, [{"role": "tool", "content": "84"}], False)
    rows = {"answer": (answer_prompt + call + environment + answer,
                       [0] * len(answer_prompt) + [1] * len(call) + [0] * len(environment) + [1] * len(answer)),
            "looping": (looping_prompt + call + environment + call,  # the last call ran; nothing follows it
                        [0] * len(looping_prompt) + [1] * len(call) + [0] * len(environment) + [1] * len(call))}
    order = PromptIterator(records, 2, seed=0).next_prompts()  # the step's prompts, in the iterator's order
    names = ["answer" if r is answer_rec else "looping" for r in order for _ in range(2)]
    length = max(len(rows[n][0]) for n in names)
    expected_ids = [rows[n][0] + [tok.pad_id] * (length - len(rows[n][0])) for n in names]
    expected_mask = [rows[n][1][1:] + [0] * (length - len(rows[n][0])) for n in names]
    assert batch["input_ids"].tolist() == expected_ids
    assert batch["loss_mask"].tolist() == expected_mask
    reward = {"answer": 0.1 + 1.0, "looping": 0.2 - 0.5}
    assert batch["rewards"].tolist() == [torch.tensor(reward[n], dtype=torch.float32).item() for n in names]
    assert batch["advantages"].tolist() == [0.0] * 4  # each group's two trajectories are the same
    assert batch["stat_turns"].item() == 2.0 and batch["stat_tool_calls"].item() == 1.5
    assert batch["stat_unfinished"].item() == 0.5 and batch["stat_truncated"].item() == 0.0
    assert batch["stat_reply_len"].item() == sum(sum(rows[n][1]) for n in names) / 4

    # the reference's log-probs, computed in the loss's micro-batch chunks, equal the training forward's: the
    # first update's KL is 0 (and its ratio 1: its old log-probs are its own)
    model.train()
    loss = policy_objective("grpo", 0.2, None, 0.1, "sequence", 0.8, batches)
    for micro in (first, second):
        logp = prefix_token_logps(model, micro["input_ids"], micro["loss_mask"], 0.8)
        m = micro["loss_mask"].bool()
        assert "old_logp" not in micro and torch.equal(logp.detach()[m], micro["ref_logp"][m])
        _, _, extras = loss(model, micro)
        assert extras["ratio"].item() == 1.0 and extras["kl"].item() == 0.0
        assert extras["turns"].item() == 2.0  # the rollout's figures ride along to the log


def test_a_trajectory_without_trained_tokens_adds_nothing_to_the_loss():
    """A trajectory whose prompt left no room for a reply (end "context") has an all-zero mask row: it neither
    adds to nor dilutes the per-sequence loss, and its gradient is zero."""
    logp = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    total, count, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, norm="sequence")
    total.backward()
    assert count.item() == 1 and torch.isfinite(total) and logp.grad[1].abs().sum().item() == 0.0


def test_a_step_whose_trajectories_all_lack_room_trains_nothing_and_stays_finite(tiny_tokenizer):
    """A context too small for any reply: every trajectory ends "context" with no sampled token; the batch's
    mask is all 0, the count 0, and the loss and its gradient finite zeros (the loop divides by max(count, 1))."""
    tok = tiny_tokenizer
    rec = record("What is 12*7?", "84")
    prompt = agent_prompt(tok, rec, TOOLS, False)
    model = scripted_model(tok, {}, max_seq_len=len(prompt) + 7)
    cfg = RLOptions(num_generations=2, temperature=1.0, max_new_tokens=8)
    batch = agent_rollout(model, tok, [rec], cfg, None, seed=3, reference=model, tools=TOOLS, max_turns=2)
    assert batch["input_ids"].tolist() == [prompt, prompt] and batch["loss_mask"].sum().item() == 0
    assert batch["rewards"].tolist() == [-0.5, -0.5] and batch["stat_unfinished"].item() == 1.0
    model.train()
    for norm in ("sequence", "token"):
        total, count, _ = policy_objective("grpo", 0.2, None, 0.1, norm, 1.0)(model, batch)
        model.zero_grad()
        total.backward()
        assert total.item() == 0.0 and count.item() == 0
        assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------- runs


def _agent_prompts(path: Path, questions=QUESTIONS) -> Path:
    """The tool run's questions as prompt records with "gt" (the system turn declares the calculator)."""
    from nanoforge.chat.calculator import CALCULATOR_SCHEMA
    with open(path, "w") as f:
        for a, op, b in questions:
            f.write(json.dumps({"conversations": [
                {"role": "system", "content": "You are a helpful assistant.", "tools": [CALCULATOR_SCHEMA]},
                {"role": "user", "content": question(a, op, b)}], "gt": evaluate(f"{a} {op} {b}")}) + "\n")
    return path


def _tool_options(**kw):
    return RLOptions(**{"tools": "calculator", "max_turns": 3, "num_generations": 2, "prompts_per_step": 2,
                        "max_new_tokens": 40, "temperature": 1.0, "beta": 0.1, **kw})


@pytest.mark.slow
def test_a_multi_turn_run_with_the_tool_run_completes_and_logs_the_agent(tool_run_dir, tmp_path):
    data = _agent_prompts(tmp_path / "agent.jsonl")
    summary = grpo(str(tool_run_dir), str(data), tmp_path / "rl", _tool_options(),
                   overrides={**FAST, "max_steps": 3, "lr": 1e-4}, quiet=True)
    assert summary["step"] == 3
    recs = [r for r in metrics_of(tmp_path / "rl") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert {"turns", "tool_calls", "unfinished", "reward_answer", "reward_calls", "kl", "ratio"} <= set(r)
    # the tool run calls the calculator, then answers: about two turns and one call per trajectory
    assert sum(r["tool_calls"] for r in recs) / 3 >= 0.5 and sum(r["turns"] for r in recs) / 3 > 1.4
    # within the agent reward's range (calls at most +0.3, the answer +1, malformed -0.2 each, unfinished -0.5)
    assert all(-1.5 < r["reward_mean"] <= 1.3 for r in recs)
    assert recs[0]["ratio"] == 1.0 and recs[0]["kl"] == 0.0
    saved = (tmp_path / "rl" / "config.toml").read_text()
    assert 'tools = "calculator"' in saved and "max_turns = 3" in saved


@pytest.mark.slow
def test_multi_turn_resume_is_bit_exact(tool_run_dir, tmp_path):
    """fp32: 3 steps then 3 more equal 6; --ppo-epochs 2 puts the step-3 checkpoint inside a rollout."""
    data = _agent_prompts(tmp_path / "agent.jsonl")
    options = _tool_options(ppo_epochs=2, max_new_tokens=32)
    common = {**FAST, "lr": 1e-3, "save_every": 3, "keep_last": 5}
    grpo(str(tool_run_dir), str(data), tmp_path / "whole", options, overrides={**common, "max_steps": 6},
         quiet=True)
    grpo(str(tool_run_dir), str(data), tmp_path / "half", options, overrides={**common, "max_steps": 3},
         quiet=True)
    state = json.loads((tmp_path / "half" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert "current" in state["data"]
    grpo(None, None, tmp_path / "half", overrides={"max_steps": 6}, resume=True, quiet=True)
    a = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "whole"))
    b = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "half"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("reward_mean", "turns", "tool_calls", "kl")
    assert [[r[k] for k in keys] for r in metrics_of(tmp_path / "whole")] == \
        [[r[k] for k in keys] for r in metrics_of(tmp_path / "half")]


def test_a_random_model_runs_two_steps(base_run, tmp_path):
    """The whole path on a model that never calls a tool: every trajectory one reply, unfinished where it runs
    to max_new_tokens. Which replies sample the end of their turn first depends on torch's sampler, not only
    on the seed (torch.multinomial draws other tokens on 2.6 than on 2.13), so the test holds for any draw."""
    data = _agent_prompts(tmp_path / "agent.jsonl", QUESTIONS[:4])
    grpo(str(base_run), str(data), tmp_path / "rl", _tool_options(max_new_tokens=6, max_turns=2),
         overrides={**FAST, "max_steps": 2, "lr": 1e-3}, quiet=True)
    recs = metrics_of(tmp_path / "rl")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["turns"] == 1.0 and r["tool_calls"] == 0.0 and r["unfinished"] == r["truncated"] for r in recs)
    assert all(r["reward_mean"] == pytest.approx(-0.5 * r["unfinished"]) for r in recs)
    assert all(r["reply_len"] <= 6.0 and (r["reply_len"] == 6.0) == (r["truncated"] == 1.0) for r in recs)
    assert recs[0]["truncated"] > 0  # 6 tokens of a random model mostly run out


def test_bad_inputs_are_clear_errors(base_run, tmp_path):
    data = _agent_prompts(tmp_path / "agent.jsonl", QUESTIONS[:4])
    lines = data.read_text().splitlines()
    no_gt = tmp_path / "no_gt.jsonl"
    no_gt.write_text("\n".join([lines[0], json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "gt"}),
                                *lines[2:]]) + "\n")
    run = partial(grpo, str(base_run), overrides=FAST)
    with pytest.raises(NanoforgeError, match=r'no_gt.jsonl:2: "gt": missing; with --tools'):
        run(str(no_gt), tmp_path / "a", _tool_options())
    with pytest.raises(NanoforgeError, match="unknown tool 'abacus'"):
        run(str(data), tmp_path / "b", _tool_options(tools="calculator,abacus"))
    with pytest.raises(NanoforgeError, match="--reward with --tools"):
        run(str(data), tmp_path / "c", _tool_options(reward="math"))
    with pytest.raises(NanoforgeError, match="--max-turns only applies"):
        run(str(data), tmp_path / "d", RLOptions(max_turns=2, num_generations=2))
    assert not any((tmp_path / n).exists() for n in "abcd")  # nothing half-written


def test_the_command_line_takes_the_flags(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nanoforge", "grpo", "--init", "x", "--data", "y", "--out",
                           str(tmp_path / "run"), "--tools", "abacus", "--max-turns", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("error: --tools: unknown tool 'abacus'"), \
        proc.stderr


@pytest.mark.slow
def test_two_processes_roll_out_their_own_trajectories(base_run, tmp_path):
    """torchrun: each rank's trajectories (of its own width) gathered into a mid-rollout checkpoint, resumed."""
    data = _agent_prompts(tmp_path / "agent.jsonl", QUESTIONS[:8])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m",
                "nanoforge", "grpo"]
    args = ["--init", str(base_run), "--data", str(data), "--tools", "calculator", "--max-turns", "2",
            "--num-generations", "2", "--prompts-per-step", "1", "--max-new-tokens", "6", "--ppo-epochs", "2",
            "--precision", "fp32", "--device", "cpu", "--tensorboard", "false", "--lr", "1e-3", "--quiet"]
    proc = subprocess.run(launcher + args + ["--out", str(tmp_path / "ddp"), "--max-steps", "3", "--save-every", "3"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert len(state["data"]["current"]) == 2
    proc = subprocess.run(launcher + ["--out", str(tmp_path / "ddp"), "--resume", "--max-steps", "4", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [r for r in metrics_of(tmp_path / "ddp") if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all("turns" in r for r in recs)
