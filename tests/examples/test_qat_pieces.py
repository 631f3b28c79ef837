"""The pieces of examples/qat (train.py and study.py reuse them): the corpus split and batches, the losses, the
schedule, mixed-precision AdamW against fp32 AdamW, the kernel-family overlay, checkpoints with the attached
policy, the metrics log on resume, the study's statistics, and the refusals. No compile: milliseconds each."""
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import la_compiler

QAT = Path(__file__).resolve().parents[2] / "examples" / "qat"
sys.path.insert(0, str(QAT))
import corpus  # noqa: E402
import report  # noqa: E402
import train  # noqa: E402
from checkpoint import CheckpointError, read_checkpoint, restore_weights, save_checkpoint, weights_of  # noqa: E402
from metrics import MetricsLog, Progress, number, read_records  # noqa: E402


# ---- corpus -------------------------------------------------------------------------------------

def _fake_stdlib(root: Path, modules: int = 40) -> None:
    for i in range(modules):
        if i % 3 == 0:
            (root / f"pkg{i}").mkdir()
            (root / f"pkg{i}" / "__init__.py").write_text(f"# package {i}\n")
            (root / f"pkg{i}" / "core.py").write_text(f"def f{i}():\n    return {i}\n" * (i + 1))
        else:
            (root / f"mod{i}.py").write_text(f"x = {i}\n" * (i + 1))
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text("left out\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "other.py").write_text("left out\n")


def test_the_split_goes_by_module_name_and_every_file_starts_with_bos(tmp_path):
    _fake_stdlib(tmp_path)
    data = corpus.load_corpus(0.25, root=tmp_path)
    assert set(data.heldout_modules) == {m for m in data.train_modules + data.heldout_modules
                                        if corpus.is_heldout(m, 0.25)}
    assert data.heldout_modules and "test" not in data.train_modules + data.heldout_modules
    expected = b"".join(b"\0" + p.read_bytes() for m in data.heldout_modules
                        for p in sorted((tmp_path / m).rglob("*.py")) + sorted(tmp_path.glob(f"{m}.py")))
    stream = data.heldout.tolist()
    assert len(stream) == len(expected) and stream.count(corpus.BOS) == expected.count(b"\0")
    assert bytes(0 if t == corpus.BOS else t for t in stream) == expected
    assert corpus.load_corpus(0.25, root=tmp_path).fingerprint == data.fingerprint


def test_batches_are_a_function_of_seed_and_step(tmp_path):
    _fake_stdlib(tmp_path)
    data = corpus.load_corpus(0.25, root=tmp_path)
    a = corpus.train_batch(data, 5, 0, 4, 16)
    assert a.shape == (4, 17) and a.dtype == torch.int64
    assert torch.equal(a, corpus.train_batch(data, 5, 0, 4, 16))
    assert not torch.equal(a, corpus.train_batch(data, 6, 0, 4, 16))
    assert not torch.equal(a, corpus.train_batch(data, 5, 1, 4, 16))
    windows = torch.cat(corpus.eval_batches(data, 6, 16, 3))
    assert windows.shape == (6, 17)
    assert torch.equal(windows[0], data.heldout[:17].long()) and torch.equal(windows[-1], data.heldout[-17:].long())
    with pytest.raises(corpus.CorpusError, match="multiple of batch_size"):
        corpus.eval_batches(data, 5, 16, 3)
    with pytest.raises(corpus.CorpusError, match="seq_len"):
        corpus.train_batch(data, 1, 0, 2, 1)
    with pytest.raises(corpus.CorpusError, match="heldout_fraction"):
        corpus.load_corpus(1.5, root=tmp_path)


# ---- losses, schedule, optimizer ---------------------------------------------------------------

def test_losses_score_the_positions_from_start():
    student, teacher = torch.randn(2, 6, 11, dtype=torch.float64), torch.randn(2, 6, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 6))
    expected = -torch.log_softmax(student[:, 2:], -1).gather(-1, targets[:, 2:, None]).mean()
    assert torch.allclose(train.lm_loss(student, targets, 2).double(), expected)
    T = 2.0
    p, q = torch.softmax(teacher[:, 3:] / T, -1), torch.softmax(student[:, 3:] / T, -1)
    kl = (p * (p.log() - q.log())).sum(-1).mean() * T * T
    assert torch.allclose(train.kd_loss(student, teacher, 3, T).double(), kl)
    assert train.kd_loss(student, student.clone(), 0).abs() < 1e-6


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = train.TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, steps=110)
    assert train.learning_rate(5, cfg, 110) == 0.5 and train.learning_rate(10, cfg, 110) == 1.0
    assert math.isclose(train.learning_rate(60, cfg, 110), 0.55)
    assert math.isclose(train.learning_rate(110, cfg, 110), 0.1)


def test_mixed_precision_adamw_follows_fp32_adamw_on_the_masters():
    torch.manual_seed(0)
    start = torch.randn(64)
    low = torch.nn.Parameter(start.to(torch.bfloat16))
    reference = torch.nn.Parameter(low.detach().float().clone())
    optimizer = train.MixedPrecisionAdamW([low], lr=1e-4, weight_decay=0.01)
    oracle = torch.optim.AdamW([reference], lr=1e-4, weight_decay=0.01)
    for _ in range(20):
        grad = torch.randn(64)
        low.grad, reference.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
        optimizer.step()
        oracle.step()
    assert torch.allclose(optimizer.masters[0], reference, atol=1e-7, rtol=0)
    assert torch.equal(low.detach(), reference.detach().to(torch.bfloat16))
    moved = (optimizer.masters[0] - start.to(torch.bfloat16).float()).abs().max()
    assert moved > 1e-3  # 20 steps of 1e-4 accumulate, though each is below a bf16 step of most weights
    state = optimizer.state_dict()
    again = train.MixedPrecisionAdamW([torch.nn.Parameter(start.to(torch.bfloat16))], lr=1e-4, weight_decay=0.01)
    again.load_state_dict(state)
    assert torch.equal(again.masters[0], optimizer.masters[0])


# ---- policies, checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["exact", "state_fp8", "decode_token_state_fp8", "prefill_operands_nvfp4"])
def test_the_kernel_family_overlay_changes_kernels_not_numerics(recipe):
    original, overlaid = la_compiler.load_policy(recipe), train.with_kernel_family(recipe, "torch")
    for module in ("layers.0.attn", "model.layers.7.attn"):
        for kind in ("gdn", "kda"):
            a, b = original.resolve(module, kind), overlaid.resolve(module, kind)
            assert b.implementation == "torch"
            assert (a.quant, a.acc, a.solve, a.chunk, a.phase, a.extra) == (b.quant, b.acc, b.solve, b.chunk,
                                                                            b.phase, b.extra)
    assert train.with_kernel_family(recipe, "auto") == original
    with pytest.raises(train.TrainConfigError, match="kernel_family"):
        train.with_kernel_family(recipe, "cuda")


def _tiny_model():
    pytest.importorskip("fla")
    return train.build_model({"vocab_size": corpus.VOCAB_SIZE, "hidden_size": 16, "num_heads": 2, "head_dim": 8,
                              "layers": ["gdn", "kda"], "use_short_conv": True}, "cpu", torch.float32)


def test_a_checkpoint_carries_the_policy_and_refuses_another(tmp_path):
    model = la_compiler.attach_policy(_tiny_model(), "state_fp8")
    path = save_checkpoint(tmp_path / "ckpt.pt", model, step=3, train_config={"seed": 1},
                           model_config={"hidden_size": 16})
    state = read_checkpoint(path)  # torch.load(weights_only=True)
    assert state["step"] == 3 and state["train_config"] == {"seed": 1}
    fresh = _tiny_model()
    assert restore_weights(fresh, state, expected_policy="state_fp8").name == "state_fp8"
    assert all(torch.equal(a, b) for a, b in zip(weights_of(fresh).values(), weights_of(model).values()))
    assert "laqat_policy" not in weights_of(fresh) and "laqat_policy" in fresh.state_dict()
    with pytest.raises(CheckpointError, match="state_fp8.*exact"):
        restore_weights(_tiny_model(), state, expected_policy="exact")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a"):
        read_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint(tmp_path / "missing.pt")


def test_a_resumed_run_keeps_its_training_config():
    args = train.parse_args(["--steps", "50"])
    stored = {**vars(train.TrainConfig()), "seed": 3}
    assert train.train_config_of(args, stored) == train.TrainConfig(seed=3, steps=50)
    with pytest.raises(train.TrainConfigError, match="--lr"):
        train.train_config_of(train.parse_args(["--lr", "1e-3"]), stored)


def test_every_flag_says_what_it_does_and_smoke_fills_in_the_flags_not_given(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    help_text = capsys.readouterr().out
    entries = re.split(r"\n  (?=-)", help_text.split("options:", 1)[1].strip())
    said = {e.split()[0]: re.match(r"-\S+(?: [A-Z_]+|{[^}]*})?\s*(.*)", e, re.S).group(1) for e in entries}
    bare = [flag for flag, text in said.items() if not text or re.fullmatch(r"\(?default [^)]*\)?", text.strip())]
    assert not bare and len(entries) > 25, bare
    assert set(train.TRAIN_HELP) == set(train.TRAIN_FLAGS)
    smoke = train.parse_args(["--smoke", "--steps", "5"])
    assert train.train_config_of(smoke, None) == train.TrainConfig(steps=5, batch_size=2, seq_len=64,
                                                                   warmup_steps=1, log_every=1)
    assert (smoke.compiler, smoke.eval_sequences, smoke.out) == ("eager", 4, "out/smoke")
    assert train.model_config_of(smoke)["layers"] == ["gdn", "kda"]
    plain = train.parse_args([])
    assert (plain.compiler, plain.eval_sequences, plain.out) == ("inductor", 64, "out/qat")


def test_a_small_learning_rate_is_printed_in_significant_digits(capsys):
    assert (number(1.5e-5), number(3e-4), number(2.31234), number(0.0)) == ("1.5e-05", "0.0003", "2.3123", "0.0000")
    Progress(10, every=1).update(1, loss=2.5, lr=1.5e-5)
    assert "loss 2.5000 lr 1.5e-05" in capsys.readouterr().out


def test_the_model_size_comes_from_the_checkpoint_and_a_flag_may_not_contradict_it():
    stored = train.model_config_of(train.parse_args(["--hidden", "32", "--heads", "2"]))
    assert stored["hidden_size"] == 32 and stored["num_heads"] == 2 and stored["layers"] == ["gdn", "kda"] * 2
    assert train.model_config_of(train.parse_args([]), stored) == stored
    assert train.model_config_of(train.parse_args(["--hidden", "32"]), stored) == stored
    with pytest.raises(train.TrainConfigError, match="--head-dim: the checkpoint's model has head_dim=64, not 8"):
        train.model_config_of(train.parse_args(["--head-dim", "8"]), stored)


@pytest.mark.parametrize("bad, match", [({"mode": "kd"}, "mode"), ({"prefill_fraction": 1.0}, "prefill_fraction"),
                                        ({"steps": 0}, "steps"), ({"kd_temperature": 0.0}, "kd_temperature")])
def test_bad_training_arguments_are_refused_by_name(bad, match):
    with pytest.raises(train.TrainConfigError, match=match):
        train.TrainConfig(**bad)


def test_dropout_is_refused():
    with pytest.raises(train.TrainConfigError, match="dropout"):
        train.check_no_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    train.check_no_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))


@pytest.mark.parametrize("argv, match", [(["--policies", "nope"], "--policies"), (["--modes", "kd"], "--modes"),
                                         (["--stage", "finetune"], "--from"), (["--seeds", ""], "--seeds")])
def test_bad_study_arguments_are_refused_by_name(argv, match):
    import study

    with pytest.raises(study.StudyError, match=match):
        study.parse_args(argv)


# ---- metrics and the study's statistics ---------------------------------------------------------

def test_a_resumed_run_drops_its_records_past_the_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    a, b = MetricsLog(path, "a"), MetricsLog(path, "b")
    for step in range(1, 6):
        a.write(kind="train", step=step, loss=float(step))
        b.write(kind="train", step=step, loss=-float(step))
    resumed = MetricsLog(path, "a", resume_step=3)
    assert [r["step"] for r in resumed.records] == [1, 2, 3]
    resumed.write(kind="train", step=4, loss=40.0, nan=float("nan"))
    records = read_records(path)
    assert [(r["run"], r["step"]) for r in records if r["run"] == "a"] == [("a", 1), ("a", 2), ("a", 3), ("a", 4)]
    assert len([r for r in records if r["run"] == "b"]) == 5 and records[-1]["nan"] == "nan"
    MetricsLog(path, "a")  # a fresh run of the same name starts over
    assert {r["run"] for r in read_records(path)} == {"b"}


def _eval(model, under, scoring, values, seed=None, trained_under=None):
    return {"model": model, "under": under, "scoring": scoring, "seed": seed, "trained_under": trained_under,
            "nll": sum(values) / len(values), "ppl": math.exp(sum(values) / len(values)), "per_sequence": values}


def _results():
    """Two policies over two seeds: 'big' costs 0.10 nats and QAT recovers half of it; 'small' costs nothing
    measurable and QAT changes nothing."""
    noise = [0.001 * ((7 * i) % 5 - 2) for i in range(40)]  # the same zero-mean wobble on every model
    level = lambda x: [x + n for n in noise]  # noqa: E731
    jitter = lambda x, i: [x + n + 0.0005 * ((i * 3) % 4 - 1.5) for i, n in enumerate(noise)]  # noqa: E731
    evals = [_eval("pretrained", "exact", "full", level(2.0)), _eval("pretrained", "big", "full", level(2.1)),
             _eval("pretrained", "small", "full", jitter(2.0, 1))]
    runs = []
    for seed in (0, 1):
        evals += [_eval("control", "exact", "full", level(1.9 + 0.001 * seed), seed, "exact"),
                  _eval("control", "big", "full", level(2.0 + 0.001 * seed), seed, "exact"),
                  _eval("control", "small", "full", jitter(1.9 + 0.001 * seed, 2), seed, "exact"),
                  _eval("qat", "big", "full", level(1.95 + 0.001 * seed), seed, "big"),
                  _eval("qad", "big", "full", level(1.96 + 0.001 * seed), seed, "big"),
                  _eval("qat", "small", "full", jitter(1.9 + 0.001 * seed, 3), seed, "small"),
                  _eval("qad", "small", "full", jitter(1.9 + 0.001 * seed, 4), seed, "small")]
        runs += [{"policy": p, "mode": m, "seed": seed, "seconds_per_step": 0.02} for p in ("big", "small")
                 for m in ("qat", "qad")]
    return {"config": {"seeds": [0, 1], "policies": ["big", "small"]}, "decode_policies": [], "evals": evals,
            "runs": runs}


def test_the_table_computes_recovery_and_says_what_is_inside_the_noise():
    results = _results()
    big, small = report.rows(results)
    assert big.recovered(big.qat) == pytest.approx([50.0, 50.0]) and big.recovered(big.qad) == pytest.approx([40, 40])
    assert big.gap().mean == pytest.approx(0.1) and not big.gap().inside_noise
    assert big.versus_control(big.qat).mean == pytest.approx(-0.05) and not big.versus_control(big.qat).inside_noise
    assert small.gap().inside_noise and small.versus_control(small.qat).inside_noise
    text = report.markdown(results)
    assert "| big | full | 2.0000 (7.389) | 2.1000 (8.166) | 2.0005 ± 0.0005 (7.393) |" in text
    assert "| 50 % ± 0 | 40 % ± 0 | 20.0 | 20.0 |" in text
    assert "| small | full |" in text and "— (gap inside the noise)" in text
    lines = report.noise_statements(results)
    assert "no QAT - exact +0.1000" in lines[0] and "QAT - control -0.0500" in lines[0]
    assert lines[0].count("beyond the noise") == 5
    assert lines[1].count("inside the noise") == 5
    json.dumps(results)


def test_paired_differences_and_their_combination():
    mean, se = report.paired([1.0, 2.0, 4.0], [0.0, 1.0, 1.0])
    assert mean == pytest.approx(5 / 3) and se == pytest.approx(math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2 / 3))
    d = report.combine([(1.0, 0.1), (3.0, 0.1)])
    assert d.mean == 2.0 and d.sigma == pytest.approx(math.sqrt(0.02 / 4 + 2.0 / 2))
    assert report.Difference(0.1, 0.05).inside_noise and not report.Difference(0.11, 0.05).inside_noise


# ---- the state-cache preset: prose, layer lists, position spans, the study's policies -------------

def _npm_tarball(path: Path, files: dict[str, str]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _fake_prose(folder: Path, monkeypatch) -> None:
    import hashlib

    import prose

    speeches = {f"data/{1790 + i}_speaker_{i}.txt": f"Address {i}. " * (40 + i) for i in range(40)}
    speeches |= {f"data/{1790 + i}_speaker_{i}.json": "{}" for i in range(3)}
    chapters = {f"data/chapter_{i}.txt": f"Chapter {i}. Call me Ishmael. " * 30 for i in range(1, 21)}
    chapters |= {"data/data.txt": "the whole book again", "data/contents.txt": "CONTENTS", "README.md": "readme"}
    tarballs = []
    for base, files in ((prose.TARBALLS[0], speeches), (prose.TARBALLS[1], chapters)):
        _npm_tarball(folder / base.filename, files)
        digest = hashlib.sha256((folder / base.filename).read_bytes()).hexdigest()
        tarballs.append(prose.NpmTarball(base.package, base.version, digest, base.prefix, base.skip))
    monkeypatch.setattr(prose, "TARBALLS", tuple(tarballs))


def test_prose_documents_are_the_data_texts_and_split_by_name(tmp_path, monkeypatch):
    import prose

    _fake_prose(tmp_path, monkeypatch)
    documents = prose.prose_documents(tmp_path)
    assert len(documents) == 60 and "sotu/1790_speaker_0" in documents and "moby_dick/chapter_7" in documents
    assert not any(name.endswith(("/data", "/contents", "README")) for name in documents)
    assert documents["moby_dick/chapter_3"] == ("Chapter 3. Call me Ishmael. " * 30).encode()
    data = corpus.load_corpus(heldout_fraction=0.2, root=tmp_path, source="prose")
    assert set(data.heldout_modules) == {m for m in documents if corpus.is_heldout(m, 0.2)}
    assert data.train_modules and data.heldout_modules and data.describe()["source"] == prose.DESCRIPTION
    assert int((data.train == corpus.BOS).sum()) == len(data.train_modules)
    assert data.train.numel() + data.heldout.numel() == sum(len(t) + 1 for t in documents.values())


def test_a_prose_tarball_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    import prose

    _fake_prose(tmp_path, monkeypatch)
    moby = tmp_path / prose.TARBALLS[1].filename
    moby.write_bytes(moby.read_bytes()[:-1] + b"x")
    with pytest.raises(prose.ProseError, match="SHA-256"):
        prose.prose_documents(tmp_path)
    with pytest.raises(prose.ProseError, match="not found.*--fetch"):
        prose.prose_documents(tmp_path / "empty")
    with pytest.raises(corpus.CorpusError, match="source"):
        corpus.load_corpus(source="wiki")


def test_a_layer_list_repeats_an_entry_with_a_count():
    assert train.layer_kinds("gdn*3,kda") == ["gdn", "gdn", "gdn", "kda"]
    assert train.layer_kinds("gdn,kda") == ["gdn", "kda"]
    for bad in ("gdn*", "gdn*0", "gdn*x"):
        with pytest.raises(train.TrainConfigError, match="--layers"):
            train.layer_kinds(bad)


class _FixedLogits:
    """A stand-in for a compiled model: returns given logits."""

    def __init__(self, logits):
        self._logits = logits

    def phase(self, prefill):
        import contextlib

        return contextlib.nullcontext()

    def logits(self, inputs):
        return self._logits[: inputs.shape[0]]


def test_the_position_spans_partition_the_scored_positions():
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (3, 14))
    logits = torch.randn(3, 13, 11)
    result = train.evaluate(_FixedLogits(logits), [tokens], start=3, spans=4)
    nll = torch.nn.functional.cross_entropy(logits[:, 3:].transpose(1, 2), tokens[:, 4:], reduction="none")
    assert result.span_starts == [3, 6, 9, 11]  # 10 positions: spans of 3, 3, 2, 2
    expected = [[row[a - 3:b - 3].mean().item() for a, b in zip([3, 6, 9, 11], [6, 9, 11, 13])] for row in nll]
    assert torch.allclose(torch.tensor(result.per_span), torch.tensor(expected), rtol=1e-6)
    assert result.per_sequence == pytest.approx(nll.mean(1).tolist(), rel=1e-6)


def test_the_position_table_finds_a_difference_that_grows_along_the_suffix():
    def record(model, under, per_span, seed=None, trained_under=None):
        per_sequence = [sum(w) / len(w) for w in per_span]
        return {"model": model, "under": under, "scoring": "suffix", "seed": seed, "trained_under": trained_under,
                "nll": sum(per_sequence) / len(per_sequence), "ppl": 1.0, "per_sequence": per_sequence,
                "per_span": per_span, "span_starts": [8, 12]}

    windows = [[2.0 + 0.01 * i, 2.0 - 0.01 * i] for i in range(8)]
    growing = [[a + 0.0001 * (-1) ** i, b + 0.2 + 0.001 * i] for i, (a, b) in enumerate(windows)]
    results = {"config": {"seeds": [0], "policies": ["int8"]}, "decode_policies": ["int8"], "runs": [],
               "evals": [record("pretrained", "exact", windows), record("pretrained", "int8", growing),
                         record("control", "int8", growing, 0, "exact"), record("control", "exact", windows, 0, "exact"),
                         record("qat", "int8", windows, 0, "int8")]}
    (row,) = report.rows(results)
    diffs = report.span_differences(row)
    first, second = diffs["no QAT - exact"]
    assert first.inside_noise and not second.inside_noise and second.mean == pytest.approx(0.2035, abs=1e-6)
    assert diffs["QAT - control"][1].mean == pytest.approx(-0.2035, abs=1e-6)
    text = report.markdown(results)
    assert "| policy | difference | from 8 | from 12 |" in text
    assert re.search(r"\| int8 \| no QAT - exact \| [+-]0\.0000 ± 0\.0001 \| \+0\.2035 ± 0\.0017 \* \|", text), text


@pytest.mark.parametrize("name, block_v, state_dtype", [
    ("decode_state_fp8_tile64", 64, None), ("decode_state_int8_block32", 64, None),
    ("decode_state_int8_head", 128, None), ("decode_state_int8_hadamard32", 64, None),
    ("decode_cache_bf16", 64, "bfloat16"), ("decode_cache_fp16", 64, "float16")])
def test_the_study_policies_decode_token_by_token_from_their_state_format(name, block_v, state_dtype):
    import study

    policy = la_compiler.load_policy(study.policy_source(name))
    (rule,) = policy.linear_attention
    assert policy.name == name and rule.cfg.decode.mode == "token" and train.is_decode_policy(policy)
    assert rule.cfg.state.block_v == block_v
    assert (rule.cfg.serving.state_dtype if rule.cfg.serving else None) == state_dtype
    assert name in study.STATE_POLICIES and study.parse_args(["--preset", "state-cache"]).policy_list == list(
        study.STATE_POLICIES)


def test_merging_two_commands_on_one_checkpoint_gives_the_table_of_one_run():
    whole = _results()
    for r in (whole,):
        r.update(corpus={"fingerprint": "f"}, pretrain={"steps": 9}, skipped=[], command="whole", seconds=1.0)
        r["config"]["modes"] = ["qat", "qad"]

    def part(modes, skipped=()):
        keep = [e for e in whole["evals"] if e["model"] in ("pretrained", "control") or e["model"] in modes]
        return {**whole, "evals": [dict(e) for e in keep], "config": {**whole["config"], "modes": list(modes)},
                "runs": [r for r in whole["runs"] if r["mode"] in modes], "command": "+".join(modes),
                "skipped": [{"run": s} for s in skipped]}

    first, second = part(["qat"], skipped=["big/qad/seed0"]), part(["qad"])
    for e in second["evals"]:  # the second command's own control: a repeat the merge drops
        if e["model"] == "control":
            e["per_sequence"] = [x + 1.0 for x in e["per_sequence"]]
    before = json.dumps([first, second])
    merged = report.merge(first, second)
    assert json.dumps([first, second]) == before, "the merge changed its inputs"
    assert report.markdown(merged) == report.markdown(whole)
    assert merged["skipped"] == [] and merged["config"]["modes"] == ["qat", "qad"]
    assert [m["command"] for m in merged["merged_from"]] == ["qat", "qad"]
    with pytest.raises(ValueError, match="another corpus or pretrained model"):
        report.merge(first, {**second, "pretrain": {"steps": 10}})
