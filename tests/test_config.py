import pytest

from nanoforge.core.config import (ConfigError, build_config, config_to_toml, load_toml,
                              parse_value, TRAIN_FIELDS)


def test_mini_preset_is_minimind_26m_shape():
    m, t = build_config("mini")
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size) == (512, 8, 8, 2, 6400)
    assert m.ffn_dim == 1408 and m.head_dim == 64  # MiniMind's intermediate_size for 512


@pytest.mark.parametrize("preset, overrides, ffn, head_dim", [
    ("minimind-3", {}, 2432, 96),  # ceil(768 pi / 64) * 64
    ("minimind-3", {"d_model": 128}, 448, 16),  # re-derived from the new width, as MiniMindConfig does
    ("minimind-3-moe", {"d_model": 256}, 832, 32),
    ("minimind-3", {"d_model": 128, "ffn_hidden": 320}, 320, 16),  # an explicit width wins
    ("mini", {"d_model": 256}, 704, 32),  # minimind2's 8/3 rule: ceil(256 * 8/3 / 64) * 64
    ("mini", {"ffn_rule": "pi"}, 1664, 64),
])
def test_the_ffn_width_follows_d_model_by_the_presets_rule(preset, overrides, ffn, head_dim, tmp_path):
    m, _ = build_config(preset, overrides=overrides)
    assert (m.ffn_dim, m.head_dim) == (ffn, head_dim)
    f = tmp_path / "c.toml"  # the same from a --config file over the preset
    f.write_text("[model]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in overrides.items()))
    assert build_config(preset, f)[0].ffn_dim == ffn


def test_an_unknown_ffn_rule_is_refused():
    with pytest.raises(ConfigError, match="ffn_rule='7/2' is not one of 8/3, pi"):
        build_config("mini", overrides={"ffn_rule": "7/2"})


def test_layers_merge_in_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nd_model = 128\nn_heads = 4\nn_kv_heads = 2\n[train]\nlr = 1e-3\nmax_steps = 7\n")
    m, t = build_config("tiny", f, {"max_steps": 9})
    assert m.d_model == 128 and m.n_layers == 2  # file over preset, preset over defaults
    assert t.lr == 1e-3 and t.max_steps == 9  # command line over file


@pytest.mark.parametrize("overrides,match", [
    ({"d_model": 100, "n_heads": 8}, "not divisible by n_heads"),
    ({"n_heads": 8, "n_kv_heads": 3}, "not divisible by n_kv_heads"),
    ({"precision": "fp8"}, "precision"),
    ({"schedule": "linear"}, "schedule"),
    ({"lr": float("nan")}, "lr=nan must be a finite number"),
    ({"epochs": float("inf")}, "epochs=inf must be a finite number"),
    ({"dropout": float("nan")}, "dropout=nan must be a finite number"),
    ({"seq_len": 4096}, "longer than the model's max_seq_len"),
    ({"batch_size": 0}, "batch_size"),
    ({"dropout": 1.5}, "dropout"),
    ({"attn_dropout": -0.5}, r"attn_dropout=-0.5 must be in \[0, 1\), or -1 for dropout's value"),
    ({"bogus": 1}, "unknown config field 'bogus'"),
])
def test_impossible_values_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config("mini", None, overrides)


def test_unknown_key_and_type_in_toml_name_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[model]\nd_modle = 128\n")
    with pytest.raises(ConfigError, match=r"bad.toml: \[model\] has unknown key 'd_modle'"):
        build_config(None, f)
    f.write_text("[train]\nlr = \"fast\"\n")
    with pytest.raises(ConfigError, match="lr = 'fast' should be a float"):
        build_config(None, f)
    f.write_text("[optim]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown section \[optim\]"):
        build_config(None, f)
    f.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(f)


def test_toml_roundtrip(tmp_path):
    m, t = build_config("tiny", None, {"wandb_project": 'my "proj"', "qk_norm": True})
    f = tmp_path / "config.toml"
    f.write_text(config_to_toml(m, t, {"run": {"data": "/x/y"}}))
    m2, t2 = build_config(None, None, None, base=load_toml(f))
    assert m2 == m and t2 == t


def test_parse_value_names_the_flag():
    assert parse_value("max_steps", TRAIN_FIELDS["max_steps"], "1e3") == 1000
    assert parse_value("tensorboard", TRAIN_FIELDS["tensorboard"], "false") is False
    with pytest.raises(ConfigError, match="--max-steps: 'ten'"):
        parse_value("max_steps", TRAIN_FIELDS["max_steps"], "ten")


def test_micro_batch_may_be_a_number_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nbatch_size = 8\nmicro_batch = 2\n")
    _, tcfg = build_config("tiny", path)
    assert tcfg.micro_batch == "2"
    path.write_text("[train]\nmicro_batch = true\n")
    with pytest.raises(ConfigError, match="micro_batch"):
        build_config("tiny", path)
