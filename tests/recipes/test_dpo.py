"""DPO: pair preparation (final-reply masks, whole pairs per split), the cached reference log-probs, the loss,
and a short run of the real training loop that must raise held-out preference accuracy."""
import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoforge.core.config import ModelConfig, build_config
from nanoforge.data.batches import IGNORE
from nanoforge.data.dpo import (DPOBatches, compute_reference_logps, count_pairs, reference_logps,
                                sequence_logps)
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.train.loop import Stage, evaluate, train
from nanoforge.train.objectives import dpo_loss, dpo_objective, pair_logps

QUIET = dict(log=lambda *a: None)
VAL_FRACTION = 0.2


def _fallback_dpo(directory: Path) -> Path:
    """A small DPO file of our own (some with a system prompt, some multi-turn) for machines without
    ../shared: the chosen reply is polite, the rejected one rude."""
    path = directory / "fallback_dpo.jsonl"
    questions = ["What is the capital of France?", "How do I boil an egg?", "Tell me about the moon.",
                 "春天为什么会下雨？", "Can you count to five?", "What colour is the sky?"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(40):
            q = questions[i % len(questions)] + f" ({i})"
            prefix = [{"role": "system", "content": "You are helpful."}] if i % 3 == 0 else []
            if i % 4 == 1:
                prefix += [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]
            prefix.append({"role": "user", "content": q})
            record = {"chosen": prefix + [{"role": "assistant", "content": f"Happy to help: answer {i}."}],
                      "rejected": prefix + [{"role": "assistant", "content": f"No. Go away {i}!"}]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="module")
def dpo_file(tmp_path_factory) -> Path:
    from conftest import shared_data_dir
    shared = shared_data_dir()
    if shared is not None:
        return shared / "tiny" / "dpo_tiny.jsonl"
    return _fallback_dpo(tmp_path_factory.mktemp("dpo_corpus"))


@pytest.fixture(scope="module")
def dpo_dir(tmp_path_factory, tiny_tokenizer, dpo_file) -> Path:
    out = tmp_path_factory.mktemp("dpo") / "prep"
    prepare_dataset("dpo", [dpo_file], tiny_tokenizer, out, val_fraction=VAL_FRACTION, workers=1, **QUIET)
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tiny_model(vocab_size: int, seed: int = 0, max_seq_len: int = 4096) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                           max_seq_len=max_seq_len))


# ---------------------------------------------------------------------------------------------- prepare


def test_pairs_are_masked_on_the_final_reply_and_never_split(dpo_dir, dpo_file, tiny_tokenizer):
    records = _records(dpo_file)
    is_val = [math.floor((i + 1) * VAL_FRACTION) > math.floor(i * VAL_FRACTION) for i in range(len(records))]
    manifest = json.loads((dpo_dir / "manifest.json").read_text())
    assert manifest["kind"] == "dpo" and manifest["layout"] == "pairs"
    assert manifest["sources"][0]["records"] == len(records)
    im_end = "<|im_end|>"
    think = "<think>\n\n</think>\n\n"  # every assistant turn opens with its (here empty) think block
    for split, wanted in (("train", False), ("val", True)):
        shards = TokenShards(dpo_dir, split)
        split_records = [r for r, v in zip(records, is_val) if v == wanted]
        assert shards.num_docs == 2 * len(split_records) > 0  # whole pairs only, in input order
        for p, record in enumerate(split_records):
            prompts = []
            for side, doc in (("chosen", 2 * p), ("rejected", 2 * p + 1)):
                ids, mask = shards.doc(doc)
                assert tiny_tokenizer.decode(ids.tolist()) == tiny_tokenizer.render_text(record[side])
                masked = np.flatnonzero(mask)
                assert masked.size and np.all(np.diff(masked) == 1), "one contiguous span"
                assert masked[-1] + 1 < len(ids)  # the template's final "\n" is not supervised
                reply = tiny_tokenizer.decode(ids[mask == 1].tolist())
                assert reply == think + record[side][-1]["content"].lstrip("\n") + im_end
                prompts.append(ids[:masked[0]].tolist())
            assert prompts[0] == prompts[1], f"pair {p} of {split}: the shared prefix tokenizes differently"


def test_multi_turn_pair_masks_only_the_last_reply(tmp_path, tiny_tokenizer):
    prefix = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Say yes."}]
    record = {"chosen": prefix + [{"role": "assistant", "content": "Yes."}],
              "rejected": prefix + [{"role": "assistant", "content": "No way."}]}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    prepare_dataset("dpo", [path], tiny_tokenizer, tmp_path / "out", val_fraction=0.0, workers=1, **QUIET)
    shards = TokenShards(tmp_path / "out", "train")
    assert shards.num_docs == 4
    for doc, text in ((0, "Yes."), (1, "No way.")):
        ids, mask = shards.doc(doc)
        assert tiny_tokenizer.decode(ids[mask == 1].tolist()) == "<think>\n\n</think>\n\n" + text + "<|im_end|>"


def test_parallel_prepare_is_byte_identical(dpo_dir, dpo_file, tiny_tokenizer, tmp_path):
    out = tmp_path / "par"
    prepare_dataset("dpo", [dpo_file], tiny_tokenizer, out, val_fraction=VAL_FRACTION, workers=2,
                    chunk_bytes=64 << 10, **QUIET)
    for name in sorted(p.name for p in dpo_dir.iterdir() if p.suffix in (".bin", ".idx", ".mask")):
        assert (out / name).read_bytes() == (dpo_dir / name).read_bytes(), name


# ---------------------------------------------------------------------------------------------- batches


def test_batches_layout_order_and_exact_resume(dpo_dir, tiny_tokenizer):
    shards = TokenShards(dpo_dir, "train")
    ref = np.arange(shards.num_docs, dtype=np.float32)  # stand-in: ref value = document index
    batches = DPOBatches(shards, ref, batch_size=3, seq_len=4096, seed=1, pad_id=tiny_tokenizer.pad_id or 0)
    offsets = shards.doc_offsets()
    seen = []
    for _ in range(4):
        b = batches.next_batch()
        ids, labels, r = b["input_ids"], b["labels"], b["ref_logps"]
        assert ids.shape == labels.shape and ids.shape[0] == 6 and r.shape == (6,)
        docs = r.long().tolist()
        chosen, rejected = docs[:3], docs[3:]
        assert all(c % 2 == 0 and rj == c + 1 for c, rj in zip(chosen, rejected))
        assert ids.shape[1] == max(int(offsets[d + 1] - offsets[d]) for d in docs) - 1  # padded to longest
        for row, d in enumerate(docs):
            tokens, mask = shards.doc(d)
            n = len(tokens)
            assert ids[row, :n - 1].tolist() == tokens[:-1].tolist()
            want = np.where(mask[1:] == 1, tokens[1:].astype(np.int64), IGNORE)
            assert labels[row, :n - 1].tolist() == want.tolist()
            assert (labels[row, n - 1:] == IGNORE).all()
        assert count_pairs(b).item() == 3
        seen += chosen
    assert len(set(seen[:shards.num_docs // 2])) == min(len(seen), shards.num_docs // 2)  # a permutation
    # exact resume: a fresh source loaded from the state continues with the same batches
    state = json.loads(json.dumps(batches.state_dict()))
    expected = [batches.next_batch() for _ in range(3)]
    again = DPOBatches(shards, ref, batch_size=3, seq_len=4096, seed=1, pad_id=tiny_tokenizer.pad_id or 0)
    again.load_state_dict(state)
    for want in expected:
        got = again.next_batch()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    with pytest.raises(NanoforgeError, match="seed"):
        DPOBatches(shards, ref, 3, 4096, seed=2).load_state_dict(state)
    # two ranks split each step's pairs between them
    r0 = DPOBatches(shards, ref, 2, 4096, seed=1, rank=0, world_size=2).next_batch()
    r1 = DPOBatches(shards, ref, 2, 4096, seed=1, rank=1, world_size=2).next_batch()
    one = DPOBatches(shards, ref, 4, 4096, seed=1).next_batch()
    assert r0["ref_logps"][:2].tolist() + r1["ref_logps"][:2].tolist() == one["ref_logps"][:4].tolist()


def test_too_long_pairs_are_skipped_and_counted(dpo_dir):
    shards = TokenShards(dpo_dir, "train")
    lengths = np.diff(shards.doc_offsets())
    seq_len = int(np.median(lengths))
    ref = np.zeros(shards.num_docs, dtype=np.float32)
    batches = DPOBatches(shards, ref, 1, seq_len, seed=0)
    too_long = int(((lengths[0::2] - 1 > seq_len) | (lengths[1::2] - 1 > seq_len)).sum())
    assert batches.skipped == too_long > 0
    assert f"{too_long} skipped" in batches.summary()
    for _ in range(len(batches.usable)):
        assert batches.next_batch()["input_ids"].shape[1] <= seq_len


# ---------------------------------------------------------------------------------------------- reference


def test_reference_logps_equal_a_direct_forward_and_the_cache_follows_the_model(dpo_dir, tiny_tokenizer, tmp_path):
    shards = TokenShards(dpo_dir, "val")
    SEQ = 1024
    model = _tiny_model(tiny_tokenizer.vocab_size)
    logs = []
    values = reference_logps(model, shards, tmp_path, batch_size=3, seq_len=SEQ, log=logs.append)
    assert (tmp_path / "ref_logps_val.npy").is_file() and "computing" in logs[-1]
    lengths = np.diff(shards.doc_offsets())
    fits = np.repeat((lengths[0::2] - 1 <= SEQ) & (lengths[1::2] - 1 <= SEQ), 2)
    assert np.isnan(values[~fits]).all() and fits.sum() >= 4  # pairs too long for SEQ are never used
    model.eval()
    with torch.no_grad():
        for doc in np.flatnonzero(fits).tolist():
            tokens, mask = shards.doc(doc)
            ids = torch.from_numpy(tokens.astype(np.int64))
            logp = torch.log_softmax(model(ids[None, :-1])[0].double(), dim=-1)  # (n-1, V)
            picked = logp[torch.arange(len(ids) - 1), ids[1:]]
            want = picked[torch.from_numpy(mask[1:] == 1)].sum().item()
            assert values[doc] == pytest.approx(want, rel=1e-4, abs=1e-3), doc
    # the same model again: reused, not recomputed
    again = reference_logps(model, shards, tmp_path, batch_size=5, seq_len=SEQ, log=logs.append)
    assert "reusing" in logs[-1] and np.array_equal(again, values, equal_nan=True)
    # a changed reference model: recomputed, and the new values are the new model's
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    changed = reference_logps(model, shards, tmp_path, batch_size=3, seq_len=SEQ, log=logs.append)
    assert "recomputing" in logs[-1]
    assert not np.allclose(changed[fits], values[fits])
    direct = compute_reference_logps(model, shards, 2, SEQ)
    np.testing.assert_allclose(changed[fits], direct[fits], rtol=1e-4, atol=1e-3)
    # an explicit fingerprint (the stage passes the init checkpoint's hash) is part of the key too
    reference_logps(model, shards, tmp_path, 3, SEQ, fingerprint="a" * 64, log=logs.append)
    assert "recomputing" in logs[-1]
    reference_logps(model, shards, tmp_path, 3, SEQ, fingerprint="a" * 64, log=logs.append)
    assert "reusing" in logs[-1]
    reference_logps(model, shards, tmp_path, 3, SEQ, fingerprint="b" * 64, log=logs.append)
    assert "recomputing" in logs[-1]


# ---------------------------------------------------------------------------------------------- loss


def test_dpo_loss_at_init_is_log2_with_zero_margin_and_gradients(dpo_dir, tiny_tokenizer):
    shards = TokenShards(dpo_dir, "val")
    model = _tiny_model(tiny_tokenizer.vocab_size)
    ref = compute_reference_logps(model, shards, 4, 1024)
    batch = DPOBatches(shards, ref, 4, 1024, seed=0).next_batch()
    model.train()
    loss_sum, n, extras = dpo_loss(model, batch, beta=0.1)
    assert int(n) == 4
    assert loss_sum.item() == pytest.approx(4 * math.log(2), abs=1e-4)
    assert extras["reward_margin"].item() == pytest.approx(0.0, abs=1e-4)
    assert abs(extras["chosen_reward"].item()) < 1e-4 and abs(extras["rejected_reward"].item()) < 1e-4
    loss_sum.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum().item() for g in grads) > 0


def test_dpo_loss_matches_a_hand_computed_example():
    # 2 pairs -> 4 rows, 3 positions, vocab 2. logits [0, 0] give log p = log 0.5 for either token;
    # logits [log 3, 0] give log p(0) = log 0.75 and log p(1) = log 0.25.
    l3 = math.log(3.0)
    logits = torch.tensor([[[l3, 0.0], [0.0, 0.0], [0.0, 0.0]],      # chosen 0: labels 0, 1, ignored
                           [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],     # chosen 1: labels 1
                           [[l3, 0.0], [l3, 0.0], [0.0, 0.0]],       # rejected 0: labels 1, 1
                           [[0.0, 0.0], [l3, 0.0], [0.0, 0.0]]])     # rejected 1: labels 0, 0
    labels = torch.tensor([[0, 1, IGNORE], [IGNORE, 1, IGNORE], [1, 1, IGNORE], [0, 0, IGNORE]])
    pc = [math.log(0.75) + math.log(0.5), math.log(0.5)]
    pr = [2 * math.log(0.25), math.log(0.5) + math.log(0.75)]
    ref = torch.tensor([-1.0, -0.5, -2.0, -1.5])
    beta = 0.5
    margins = [beta * ((pc[i] - ref[i].item()) - (pr[i] - ref[2 + i].item())) for i in range(2)]
    want = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins)
    logits.requires_grad_(True)
    assert sequence_logps(logits, labels).tolist() == pytest.approx(pc + pr, abs=1e-6)
    loss_sum, n, extras = dpo_objective(sequence_logps(logits, labels), ref, beta=beta)
    assert int(n) == 2 and loss_sum.item() == pytest.approx(want, abs=1e-5)
    assert extras["reward_margin"].item() == pytest.approx(sum(margins) / 2, abs=1e-5)
    assert extras["reward_accuracy"].item() == pytest.approx(sum(m > 0 for m in margins) / 2)
    assert extras["chosen_reward"].item() == pytest.approx(
        beta * sum(pc[i] - ref[i].item() for i in range(2)) / 2, abs=1e-5)
    # the gradient pushes the chosen replies up and the rejected ones down
    loss_sum.backward()
    g = logits.grad
    assert g[0, 0, 0] < 0 and g[2, 0, 1] > 0


def test_a_pairs_rows_share_their_prompts_pass_with_each_rows_own_log_probs_and_gradients(dpo_dir, tiny_tokenizer):
    """pair_logps packs a pair's chosen and rejected rows behind one pass over their prompt where that pays
    (model/prefix.py): the same sums and gradients as each row alone."""
    shards = TokenShards(dpo_dir, "val")
    model = _tiny_model(tiny_tokenizer.vocab_size)
    batch = DPOBatches(shards, compute_reference_logps(model, shards, 4, 1024), 4, 1024, seed=0).next_batch()
    ids, labels = batch["input_ids"], batch["labels"]
    weights = torch.linspace(-1.0, 1.0, len(ids))
    (sequence_logps(model(ids), labels) * weights).sum().backward()
    alone = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    seen = []
    model.model.embed_tokens.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel()))
    shared = pair_logps(model, ids, labels)
    (shared * weights).sum().backward()
    torch.testing.assert_close(shared, sequence_logps(model(ids), labels), atol=1e-4, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, alone[name], atol=1e-5, rtol=1e-4, msg=name)
    # a pair whose prompt is long against its replies goes through as one row: the prompt once
    prompt, replies = torch.arange(2, 42), torch.tensor([[50, 51, 52], [60, 61, 62]])
    pair = torch.stack([torch.cat([prompt, r]) for r in replies])  # (2, 43) tokens
    labels = torch.where(torch.arange(42) >= 39, pair[:, 1:], torch.full((2, 42), IGNORE))
    seen.clear()
    torch.testing.assert_close(pair_logps(model, pair[:, :-1], labels), sequence_logps(model(pair[:, :-1]), labels),
                               atol=1e-4, rtol=1e-5)
    assert seen[0] == 40 + 2 * 3 < 2 * 42


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def hh_dir(tmp_path_factory, tiny_tokenizer):
    """English harmlessness pairs (Anthropic hh-rlhf test split, 2,299 pairs), most of them short."""
    from conftest import _missing_shared_data, shared_data_dir
    shared = shared_data_dir()
    path = shared / "minimind" / "dpo_en_hh_rlhf_harmless_test.jsonl" if shared is not None else None
    if path is None or not path.is_file():
        _missing_shared_data("the DPO training test")
    out = tmp_path_factory.mktemp("hh") / "prep"
    prepare_dataset("dpo", [path], tiny_tokenizer, out, val_fraction=0.1, workers=1, **QUIET)
    return out


@pytest.mark.slow
def test_dpo_training_raises_held_out_preference_accuracy(hh_dir, tiny_tokenizer, tmp_path):
    """The real loop (Stage.count_fn = count_pairs) on hh-rlhf pairs from a random-init tiny GPT: the training
    loss leaves log 2, and on held-out pairs the loss falls below log 2 while the reward margin and accuracy
    rise above their starting 0 (measured: val loss 0.693 -> 0.691, margin 0 -> 0.070, accuracy -> 0.58 on 55
    held-out pairs with the tokenizer `tokenizer train` writes now; 0.667, 0.10, 0.61 with the GPT-2 split
    pattern it used before; a sign error in the loss or the pair layout drives all three the other way)."""
    seq_len = 192
    mcfg, tcfg = build_config("tiny", None, {
        "vocab_size": tiny_tokenizer.vocab_size, "max_seq_len": seq_len, "seq_len": seq_len, "batch_size": 8,
        "max_steps": 40, "lr": 1e-3, "warmup_steps": 5, "weight_decay": 0.0, "precision": "fp32",
        "device": "cpu", "tensorboard": False, "log_every": 10, "eval_every": 40, "eval_batches": 8,
        "save_every": 0})
    torch.manual_seed(0)
    model = GPT(mcfg)
    train_shards, val_shards = TokenShards(hh_dir, "train"), TokenShards(hh_dir, "val")
    ref_train = reference_logps(model, train_shards, tmp_path / "cache", 16, seq_len, **QUIET)
    ref_val = reference_logps(model, val_shards, tmp_path / "cache", 16, seq_len, **QUIET)
    batches = DPOBatches(train_shards, ref_train, tcfg.batch_size, seq_len, tcfg.seed)
    val = DPOBatches(val_shards, ref_val, tcfg.batch_size, seq_len, shuffle=False)
    assert len(val.usable) >= 40
    loss_fn = functools.partial(dpo_loss, beta=0.1)
    before = evaluate(model, val.eval_batches(tcfg.eval_batches), loss_fn, torch.device("cpu"), "fp32")
    assert before[0] == pytest.approx(math.log(2), abs=1e-3) and abs(before[2]["reward_margin"]) < 1e-3
    stage = Stage("dpo", batches, loss_fn, lambda: val.eval_batches(tcfg.eval_batches), count_fn=count_pairs)
    summary = train(stage, model, mcfg, tcfg, tmp_path / "run", quiet=True)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert np.mean(losses[-3:]) < math.log(2) - 0.02
    val_loss, pairs, extras = evaluate(model, val.eval_batches(tcfg.eval_batches), loss_fn,
                                       torch.device("cpu"), "fp32")
    assert pairs == before[1] and summary["val_loss"] == pytest.approx(val_loss, abs=1e-5)
    assert val_loss < math.log(2)
    assert extras["reward_margin"] > 0.03 and extras["reward_accuracy"] > 0.55


@pytest.mark.slow
def test_dpo_stage_end_to_end_with_cached_reference_and_resume(hh_dir, tiny_tokenizer, tmp_path):
    """`dpo` as users run it: --init a run, the reference cached in the run, held-out reward metrics logged,
    exact resume."""
    import shutil
    from nanoforge.weights import checkpoint as ckpt
    from nanoforge.recipes.dpo import dpo
    mcfg, _ = build_config("tiny", None, {"vocab_size": tiny_tokenizer.vocab_size, "max_seq_len": 192})
    torch.manual_seed(0)
    base = GPT(mcfg)
    tiny_tokenizer.save(tmp_path / "base" / "tokenizer")
    ckpt.save_checkpoint(tmp_path / "base", 0, base.state_dict_for_save(), {},
                         {"config": {"model": dataclasses.asdict(mcfg), "train": {"seq_len": 192}}})
    common = {"max_steps": 20, "lr": 1e-3, "precision": "fp32", "tensorboard": False, "log_every": 5,
              "eval_every": 10, "save_every": 10, "keep_last": 5, "eval_batches": 4, "sample_every": 10}
    s = dpo(str(tmp_path / "base"), [str(hh_dir)], tmp_path / "run", overrides=common, quiet=True)
    assert (tmp_path / "run" / "ref_logps_train.npy").is_file()
    # samples through the chat template at steps 10 and 20, and the report at the end
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in samples}) == [10, 20] and all(r["new_tokens"] > 0 for r in samples)
    assert (tmp_path / "run" / "report.md").is_file()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [10, 20]
    assert all("val_reward_margin" in r and "val_reward_accuracy" in r for r in val)
    assert val[-1]["val_reward_margin"] > 0 and s["val_loss"] < math.log(2)
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000020")
    dpo(None, [], tmp_path / "again", resume=True, quiet=True)
    a = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "run"))
    b = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "again"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
