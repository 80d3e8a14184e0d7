"""SFT: packed rows with assistant-only labels, turn-boundary truncation, and the sft stage end to end."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanoforge.core.config import ModelConfig
from nanoforge.data.batches import IGNORE, SFTBatches, fit_to_window, pack_rows
from nanoforge.data.prepare import prepare_dataset
from nanoforge.data.shards import TokenShards
from nanoforge.core.errors import NanoforgeError
from nanoforge.model.gpt import GPT
from nanoforge.weights import checkpoint as ckpt
from nanoforge.recipes.pretrain import pretrain
from nanoforge.recipes.sft import sft

QUIET = dict(log=lambda *a: None)
FAST = {"tensorboard": False, "log_every": 1, "eval_every": 0, "precision": "fp32", "warmup_steps": 2}


# Words for the conversations this module writes itself when ../shared is absent (or hidden).
_EN_WORDS = ("apple river lantern quiet garden market winter candle harbor violin pebble meadow thunder basket "
             "compass orchard ladder silver forest kettle blanket mirror sparrow window bridge pepper island "
             "journey marble feather canyon cottage whistle velvet glacier meadowlark tulip copper engine "
             "puzzle harvest blossom anchor pillow chimney saddle valley").split()
_ZH_WORDS = ("山川 河流 花园 灯笼 市场 冬天 蜡烛 港口 小提琴 石子 草地 雷声 篮子 指南针 果园 梯子 银色 森林 水壶 "
             "毯子 镜子 麻雀 窗户 桥梁 胡椒 岛屿 旅途 羽毛 峡谷 小屋 口哨 冰川 郁金香 铜器 发动机 拼图 收获 "
             "花朵 船锚 枕头 烟囱 马鞍 山谷").split()


def _own_sft_corpus(directory: Path, n: int = 360, seed: int = 0) -> list[Path]:
    """Multi-turn conversations written here (seeded): English and Chinese, some with a system prompt, most
    of a few turns and about one in five of 6 to 10 turns, long enough that a 512-token window cuts them (with
    the vocab-512 test tokenizer); each opens with a numbered user turn, so no two renderings share a start."""
    import random
    rng = random.Random(seed)

    def sentence(zh: bool, lo: int, hi: int) -> str:
        words = rng.choices(_ZH_WORDS if zh else _EN_WORDS, k=rng.randint(lo, hi))
        return ("".join(words) + "。") if zh else (" ".join(words).capitalize() + ".")

    path = directory / "own_sft.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            zh = rng.random() < 0.5
            conv = []
            if rng.random() < 0.3:
                conv.append({"role": "system", "content": sentence(zh, 3, 8)})
            exchanges = rng.randint(6, 10) if rng.random() < 0.2 else rng.randint(1, 3)
            for t in range(exchanges):
                question = sentence(zh, 3, 12)
                conv.append({"role": "user", "content": f"#{i}: {question}" if t == 0 else question})
                conv.append({"role": "assistant", "content": " ".join(sentence(zh, 4, 12)
                                                                      for _ in range(rng.randint(1, 2)))})
            f.write(json.dumps({"conversations": conv}, ensure_ascii=False) + "\n")
    return [path]


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    """Real multi-turn conversations from ../shared/data (KdConv's 10 to 32 turns, and the tiny mix), or,
    without it, conversations of the same kind written here: the packing and mask tests run on both."""
    from conftest import shared_data_dir
    shared = shared_data_dir()
    if shared is not None:
        return [shared / "minimind" / "sft_zh_kdconv.jsonl", shared / "tiny" / "sft_tiny.jsonl"]
    return _own_sft_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, tiny_tokenizer, sft_files):
    out = tmp_path_factory.mktemp("sft") / "prep"
    prepare_dataset("sft", sft_files, tiny_tokenizer, out, val_fraction=0.05, workers=1, **QUIET)
    return out


def conversations(files):
    for f in files:
        for line in Path(f).read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)["conversations"]


def test_labels_are_exactly_the_assistant_replies(sft_dir, sft_files, tiny_tokenizer):
    """Decode each packed segment's labels: they must be the conversation's assistant contents, each
    followed by <|im_end|>, in order, and nothing else (no user or system text)."""
    shards = TokenShards(sft_dir, "train")
    batches = SFTBatches(shards, batch_size=4, seq_len=2048, seed=0)
    # every conversation of the train split, in file order (val docs are the ones the split rule took)
    convs = list(conversations(sft_files))
    total_docs = len(convs)
    f = 0.05
    train_convs = [c for i, c in enumerate(convs) if not (int((i + 1) * f) > int(i * f))]
    assert len(train_convs) == shards.num_docs
    checked = 0
    for _ in range(3):
        b = batches.next_batch()
        for row in range(4):
            ids, labels, segs = b["input_ids"][row], b["labels"][row], b["segment_ids"][row]
            for s in segs.unique().tolist():
                if s < 0:
                    assert (labels[segs == s] == IGNORE).all()  # padding carries no loss
                    continue
                seg_ids = ids[segs == s]
                # find which conversation this is: the one whose rendering starts with these tokens
                text = tiny_tokenizer.decode(seg_ids.tolist())
                conv = next(c for c in train_convs if tiny_tokenizer.render_text(c).startswith(text))
                supervised = labels[segs == s]
                got = tiny_tokenizer.decode(supervised[supervised != IGNORE].tolist())
                expected = "".join("<think>\n\n</think>\n\n" + m["content"].lstrip("\n") + "<|im_end|>"
                                   for m in conv if m["role"] == "assistant")  # each turn behind its think block
                if len(seg_ids) + 1 == len(tiny_tokenizer.render_chat(conv)[0]):
                    assert got == expected
                else:  # truncated at a turn boundary: a prefix made of whole replies
                    assert expected.startswith(got) and got.endswith("<|im_end|>")
                checked += 1
    assert checked >= 12 and total_docs > shards.num_docs


def test_packing_wastes_little(sft_dir):
    # with a window that fits nearly every conversation (the vocab-512 test tokenizer makes them long)
    rep = SFTBatches(TokenShards(sft_dir, "train"), batch_size=2, seq_len=2048, seed=0).report
    assert rep.padding_fraction < 0.10, rep.summary(2048)
    # kdconv dialogues run past 512 tokens: cut at a turn boundary, counted
    rep = SFTBatches(TokenShards(sft_dir, "train"), batch_size=2, seq_len=512, seed=0).report
    assert rep.truncated > 0


def test_segments_attend_only_to_themselves(sft_dir):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=512)).eval()
    b = SFTBatches(TokenShards(sft_dir, "train"), batch_size=1, seq_len=512, seed=3).next_batch()
    segs = b["segment_ids"][0]
    with torch.no_grad():
        packed = model(b["input_ids"], segment_ids=b["segment_ids"])[0]
        for s in segs.unique().tolist():
            if s < 0:
                continue
            alone = model(b["input_ids"][:, segs == s])[0]
            torch.testing.assert_close(packed[segs == s], alone, atol=1e-5, rtol=1e-4)


def test_pack_rows_places_every_document_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    order = rng.permutation(500)
    rows = pack_rows(lengths, order, capacity=128, lookahead=16)
    flat = [d for r in rows for d in r]
    assert sorted(flat) == list(range(500))
    assert all(sum(lengths[d] for d in r) <= 128 for r in rows)
    fill = lengths.sum() / (len(rows) * 128)
    assert fill > 0.9
    assert rows == pack_rows(lengths, order, capacity=128, lookahead=16)


def test_fit_to_window_cuts_only_after_a_reply():
    #          sys/user .... | reply 1 + im_end | \n user ... | reply 2 + im_end | \n
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0], dtype=np.uint8)
    assert fit_to_window(mask, 20) == 15  # fits whole
    assert fit_to_window(mask, 13) == 7  # reply 2 does not fit: keep through reply 1's im_end
    assert fit_to_window(mask, 6) == 0  # not even reply 1: skip
    assert fit_to_window(np.zeros(5, dtype=np.uint8), 10) == 0  # nothing to learn


def test_resume_replays_the_same_batches(sft_dir):
    shards = TokenShards(sft_dir, "train")
    a = SFTBatches(shards, 2, 256, seed=1)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch() for _ in range(40)]  # crosses an epoch boundary
    b = SFTBatches(shards, 2, 256, seed=1)
    b.load_state_dict(state)
    for e in expected:
        got = b.next_batch()
        for k in e:
            assert torch.equal(e[k], got[k])
    with pytest.raises(NanoforgeError, match="seq_len"):
        SFTBatches(shards, 2, 128, seed=1).load_state_dict(state)


def test_pretrain_data_is_refused(tmp_path, tiny_tokenizer):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    prepare_dataset("pretrain", [f], tiny_tokenizer, tmp_path / "pre", val_fraction=0.0, workers=1, **QUIET)
    with pytest.raises(NanoforgeError, match="--kind sft"):
        SFTBatches(TokenShards(tmp_path / "pre", "train"), 1, 64)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tiny_tokenizer, sft_files):
    from conftest import tiny_corpus
    root = tmp_path_factory.mktemp("pre")
    files = tiny_corpus(root)[:1]
    prepare_dataset("pretrain", files, tiny_tokenizer, root / "data", val_fraction=0.1, workers=1, **QUIET)
    pretrain([str(root / "data")], root / "run", preset="tiny",
             overrides={**FAST, "max_steps": 20, "seq_len": 128}, quiet=True)
    return root / "run"


@pytest.mark.slow
def test_sft_stage_learns_the_replies_and_resumes(pretrained, sft_dir, tmp_path):
    out = tmp_path / "sft"
    common = {**FAST, "max_steps": 30, "lr": 3e-3, "batch_size": 4, "save_every": 15, "keep_last": 5,
              "eval_every": 15}
    s = sft(str(pretrained), [str(sft_dir)], out, overrides=common, quiet=True)
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3
    assert s["val_loss"] < recs[[i for i, r in enumerate(recs) if "val_loss" in r][0]]["val_loss"] + 1e-9
    assert all(r["supervised_tokens_per_s"] <= r["tokens_per_s"] for r in recs if "loss" in r)
    # the initial weights came from the pretrained run, not a fresh init
    init_w = ckpt.load_weights_file(ckpt.latest_checkpoint(pretrained))
    model = GPT(ModelConfig(**ckpt.load_state(ckpt.latest_checkpoint(out))["config"]["model"]))
    assert model.model.embed_tokens.weight.shape == init_w["model.embed_tokens.weight"].shape
    # resume from the middle reproduces the end exactly
    import shutil
    shutil.copytree(out, tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_000030")
    sft(None, [], tmp_path / "again", resume=True, quiet=True)
    a = ckpt.load_weights_file(ckpt.latest_checkpoint(out))
    b = ckpt.load_weights_file(ckpt.latest_checkpoint(tmp_path / "again"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sft_refuses_shape_changes_and_foreign_data(pretrained, tmp_path, tiny_tokenizer):
    with pytest.raises(NanoforgeError, match="model shape comes from --init"):
        sft(str(pretrained), [], tmp_path / "x", overrides={"d_model": 128}, quiet=True)
    with pytest.raises(NanoforgeError, match="--init is required"):
        sft(None, [], tmp_path / "y", quiet=True)
    # a pretraining recipe's [model] section is not the init's shape: named, field by field, before any work
    root = Path(__file__).resolve().parents[2]
    with pytest.raises(NanoforgeError, match=r"d_model 64, requested 512 \(by --config .*mini\.toml\)"):
        sft(str(pretrained), [], tmp_path / "w", config_file=str(root / "configs" / "mini.toml"), quiet=True)
    assert not (tmp_path / "w").exists()
    with pytest.raises(NanoforgeError, match="no such run or checkpoint"):
        sft(str(tmp_path / "nope"), [], tmp_path / "z", quiet=True)
