"""Start-up checks: a bad flag or shard stops the run at once with one line naming it, before the
process group, model, loader or log exist (check_args in train_gpt.py); and a bad call of one of the
speedrun's functions raises one line naming the function (each check beside its function)."""
import dataclasses
import os
import pathlib
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt as tg  # noqa: E402
import warm_python  # noqa: E402

SCRIPT = os.path.join(ROOT, "train_gpt.py")
VAL_SHARD = os.path.join(ROOT, "data", "tinyshakespeare", "tinyshakespeare_val_000000.bin")
TRAIN_SHARD = os.path.join(ROOT, "data", "tinyshakespeare", "tinyshakespeare_train_000001.bin")
# The start-up error of a run that never got anywhere: one line, well inside this limit (the bug it
# guards against compiled the model for 97 s first)
QUICK_S = 60


def start_up_error(tmp_path, *flags, world_size=1) -> str:
    """parse_args' or check_args' SystemExit message for the test preset with these flags; the
    directories a run would write to (log, checkpoints) are in tmp_path and must stay absent."""
    with pytest.raises(SystemExit) as e:
        args = tg.parse_args(["--preset", "test", "--log_dir", str(tmp_path / "logs"),
                              "--checkpoint_dir", str(tmp_path / "ckpt"), *flags])
        tg.check_args(args, world_size)
    return one_line(str(e.value), tmp_path)


def one_line(message: str, tmp_path) -> str:
    assert message.startswith("error: ") and "\n" not in message.strip(), message
    assert "Traceback" not in message
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()
    return message


def run_script(tmp_path, *flags) -> str:
    """train_gpt.py in a subprocess (compile on, as by default): its stderr, which must be one line."""
    r = warm_python.run([SCRIPT, "--preset", "test", "--log_dir", str(tmp_path / "logs"),
                         "--checkpoint_dir", str(tmp_path / "ckpt"), *flags], timeout=QUICK_S, cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert r.stdout == ""
    return one_line(r.stderr, tmp_path)


def test_every_numeric_field_has_a_range():
    """Hyperparameters' and Stage's numeric fields, and only they, have an allowed range (KNOB_RANGES)."""
    defaults = tg.Hyperparameters()
    numeric = {f.name for f in dataclasses.fields(tg.Hyperparameters)
               if isinstance(getattr(defaults, f.name), (int, float, tuple))
               and not isinstance(getattr(defaults, f.name), bool) and f.name not in ("stages", "layers")}
    row = tg.STAGES[0]
    columns = {f.name for f in dataclasses.fields(tg.Stage)  # shares: check_stages; untie: a switch
               if f.name != "share" and not isinstance(getattr(row, f.name), bool)}
    assert all(isinstance(getattr(row, name), (int, float, tuple)) for name in columns)
    assert set(tg.KNOB_RANGES) == numeric | columns, "give the new field its allowed range in KNOB_RANGES"


@pytest.mark.parametrize("preset", sorted(tg.PRESETS))
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_presets_pass(preset, world_size):
    args = tg.parse_args(["--preset", preset, "--train_files", TRAIN_SHARD, "--val_files", VAL_SHARD,
                          "--val_tokens", "32768"])  # tiny Shakespeare's val shard holds 36032 tokens
    tg.check_args(args, world_size)


def test_negative_iterations_stop_at_once(tmp_path):
    """The issue's case: it used to compile for 97 s and stop with "checkpoint at step 0 is past the
    untie step but still tied"."""
    assert run_script(tmp_path, "--num_iterations", "-3") == "error: --num_iterations -3 must be >= 1\n"


@pytest.mark.parametrize("flag,value", [
    ("--num_iterations", "0"), ("--extension_iterations", "-1"), ("--micro_batches", "0"),
    ("--mudd_hidden", "0"), ("--model_dim", "-64"), ("--head_dim", "0"), ("--mlp_hidden", "0"),
    ("--ngram_rows", "1"), ("--window_block_size", "0"), ("--val_tokens", "0"), ("--val_seq_len", "0"),
    ("--val_loss_every", "-1"), ("--save_every", "-5"), ("--sample_tokens", "-1"), ("--seed", "-1"),
    ("--dc_window", "0"), ("--keep_checkpoints", "-1"),
])
def test_counts(tmp_path, flag, value):
    msg = start_up_error(tmp_path, flag, value)
    assert msg.startswith(f"error: {flag} {value} must be "), msg


@pytest.mark.parametrize("flag,value,shown", [
    ("--muon_lr", "-0.01", "-0.01"), ("--adam_lr", "nan", "nan"), ("--muon_wd", "inf", "inf"),
    ("--adam_wd=-1e-3", None, "-0.001"),  # argparse takes a bare -1e-3 for an option
    ("--stage_lr_mult", "(1.0, 1.52, 1.73, -0.5)", "(1.0, 1.52, 1.73, -0.5)"),  # the extension's: the lr floor
    ("--stage_lr_mult", "(1.0, -1.0, 1.0, 0.15)", "(1.0, -1.0, 1.0, 0.15)"),
    ("--stage_lr_mult", "(1.0, 1e999, 1.0, 0.15)", "(1.0, inf, 1.0, 0.15)"),  # a literal that overflows to inf
])
def test_rates(tmp_path, flag, value, shown):
    msg = start_up_error(tmp_path, *([flag] if value is None else [flag, value]))
    assert msg.startswith(f"error: {flag.split('=')[0]} {shown} must be ") and "finite number" in msg, msg


@pytest.mark.parametrize("flag,value", [
    ("--cooldown_start", "1.5"), ("--cooldown_start", "nan"), ("--momentum_warmup", "-0.1"),
    ("--momentum_cooldown", "2"), ("--momentum_min", "-0.1"), ("--momentum_max", "1.0"),
])
def test_fractions_and_momentum(tmp_path, flag, value):
    msg = start_up_error(tmp_path, flag, value)
    assert msg.startswith(f"error: {flag} ") and " must be a finite number in [0, 1" in msg, msg


@pytest.mark.parametrize("flag,value,expect", [
    ("--stage_batch_tokens", "(512, -1024, 1536, 1536)", "must be 4 integers >= 1"),
    ("--stage_batch_tokens", "(512.0, 1024, 1536, 1536)", "must be 4 integers >= 1"),
    ("--stage_max_doc_len", "(64, 128, 128, 0)", "must be 4 integers >= 1"),
    ("--stage_windows", "((1, 3), (3, 0), (5, 11), (6, 13))", "must be 4 x 2 integers >= 1"),
    ("--stage_windows", "((1, 3), (3, 7), (5, 11), (6,))", "must be 4 x 2 integers >= 1"),
    ("--windows_init", "(1, 'a')", "must be 2 integers >= 1"),
    ("--final_val_windows", "(6,)", "must be 2 integers >= 1"),
    ("--stage_mtp_start", "((1.0, 0.5), (1.0, 0.5, 0.0), (1.0, 0.0, 0.0), (1.0, 0.0, 0.0))",
     "must be 4 x K finite numbers >= 0"),
    ("--stage_mtp_end", "((1.0, -0.5, 0.0), (1.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.0, 0.0, 0.0))",
     "must be 4 x K finite numbers >= 0"),
    ("--stage_prefix_end", "(0.25, -0.1, 0.0, 0.0)", "must be 4 finite numbers >= 0"),
])
def test_tuples(tmp_path, flag, value, expect):
    msg = start_up_error(tmp_path, flag, value)
    assert msg.startswith(f"error: {flag} (") and expect in msg, msg


@pytest.mark.parametrize("flag,value,expect", [
    ("--stage_batch_tokens", "(512, 1024)", "needs 4 values (one per stage, extension included), got 2"),
    ("--stage_windows", "(1, 3)", "needs 4 values (one per stage, extension included), got 2"),
    ("--stage_prefix_start", "(0.25, 0.25)", "needs 4 values (one per stage, extension included), got 2"),
    ("--stage_share", "(0.5, 0.25, 0.5, None)", "the scheduled stages' shares must add up to 1"),
    ("--stage_share", "(0.5, 0.25, 0.25, 0.1)", "the last row (the extension) None"),
    ("--stage_share", "(0.5, 0.0, 0.5, None)", "scheduled stages need shares in (0, 1]"),
])
def test_stage_columns(tmp_path, flag, value, expect):
    """A column flag sets one value per stage row, the extension last."""
    msg = start_up_error(tmp_path, flag, value)
    assert msg.startswith(f"error: {flag} ") and expect in msg, msg


def test_stage_columns_set_rows():
    args = tg.parse_args(["--preset", "test", "--stage_windows", "((2, 4), (3, 7), (5, 11), (6, 13))",
                          "--stage_share", "(0.5, 0.25, 0.25, None)", "--num_iterations", "8"])
    assert [row.windows for row in args.stages] == [(2, 4), (3, 7), (5, 11), (6, 13)]
    assert tg.stage_bounds(args) == (0, 4, 6, 8, 9)
    assert [tg.plan_step(args, s).windows for s in (3, 4, 8)] == [(2, 4), (3, 7), (6, 13)]
    assert [row.batch_tokens for row in args.stages] == [512, 1024, 1536, 1536]  # the preset's, kept


def test_tuple_cross_checks(tmp_path):
    msg = start_up_error(tmp_path, "--stage_mtp_start", "((1.0, 0.5), (1.0, 0.5), (1.0, 0.0), (1.0, 0.0))")
    assert "--stage_mtp_start and --stage_mtp_end must give the same number" in msg
    msg = start_up_error(tmp_path, "--val_tokens", "1000")
    assert msg == "error: --val_tokens 1000 must be a multiple of --val_seq_len 512"


@pytest.mark.parametrize("flag,value,expect", [
    ("--fp8", "maybe", "error: --fp8 'maybe' is not a valid true/false"),
    ("--mudd_hidden", "four", "error: --mudd_hidden 'four' is not a valid int"),
    ("--muon_lr", "fast", "error: --muon_lr 'fast' is not a valid float"),
    ("--stage_windows", "((1, 3", "error: --stage_windows '((1, 3' is not a valid tuple"),
    ("--layers", "('paired short', 'attn sideways')", "error: --layers row 1 ('attn sideways'): unknown word(s)"),
    ("--layers", "('paired short long',)", "error: --layers row 0 ('paired short long'): more than one window"),
    ("--ablate", "xsa,wings", "error: --ablate 'wings' is not one of xsa, attn_gates"),
    ("--num_iterationz", "5", "error: unknown argument '--num_iterationz'"),
])
def test_booleans_and_unparsable_values(tmp_path, flag, value, expect):
    """parse_args itself turns these into one line, before check_args."""
    with pytest.raises(SystemExit) as e:
        tg.parse_args(["--preset", "test", "--log_dir", str(tmp_path / "logs"), flag, value])
    assert one_line(str(e.value), tmp_path).startswith(expect), str(e.value)


@pytest.mark.parametrize("flag,value,expect", [
    ("--orthogonalizer", "foo", "error: --orthogonalizer 'foo' is not one of anvil_cascade, auto, gram_newton_schulz, polar_express"),
    ("--matrix_optimizer", "sgd", "error: --matrix_optimizer 'sgd' is not one of normuon, muon, adamw, anvil"),
    ("--attention_kernel", "fa3", "error: --attention_kernel 'fa3' is not one of auto, flex, varlen"),
])
def test_string_choices(tmp_path, flag, value, expect):
    assert start_up_error(tmp_path, flag, value) == expect


def test_model_and_batch_split_checks_run_at_start_up(tmp_path):
    """_check_model_args and check_batch_split keep their own checks; check_args runs both first."""
    msg = start_up_error(tmp_path, "--model_dim", "65")
    assert msg.startswith("error: model config: --model_dim (65) must equal --num_heads * --head_dim"), msg
    msg = start_up_error(tmp_path, "--layers", "('skip', 'paired short save_skip', 'attn long xsa save_h post_gates',"
                         " 'attn short ve mudd')")
    assert msg == "error: model config: --layers row 0 (skip): a skip row must come after the save_skip row", msg
    msg = start_up_error(tmp_path, world_size=3)
    assert "(--stage_batch_tokens) does not split into 3 ranks x 2 accumulation steps" in msg, msg


def test_truncated_val_shard_stops_at_once(tmp_path):
    val = tmp_path / "data" / "val_000000.bin"
    val.parent.mkdir()
    val.write_bytes(pathlib.Path(VAL_SHARD).read_bytes()[:3000])
    msg = run_script(tmp_path, "--val_files", str(tmp_path / "data" / "val_*.bin"))
    assert msg.startswith(f"error: {val}: header says ") and "truncated or corrupt" in msg, msg


@pytest.mark.parametrize("damage", ["bad_magic", "empty", "truncated"])
def test_corrupt_train_shard(tmp_path, damage):
    """Every train shard is checked at start-up, not only the first: a bad later shard would otherwise
    stop the run when the loader's background thread reaches it."""
    shards = tmp_path / "data"
    shards.mkdir()
    shutil.copy(TRAIN_SHARD, shards / "train_000001.bin")
    bad = shards / "train_000002.bin"
    data = bytearray(pathlib.Path(TRAIN_SHARD).read_bytes())
    if damage == "bad_magic":
        data[:4] = b"\0\0\0\0"
    bad.write_bytes(bytes(data) if damage == "bad_magic" else b"" if damage == "empty" else bytes(data[:-2]))
    msg = start_up_error(tmp_path, "--train_files", str(shards / "train_*.bin"))
    assert msg.startswith(f"error: {bad}: "), msg


def test_val_tokens_beyond_the_val_shards(tmp_path):
    msg = start_up_error(tmp_path, "--val_tokens", "65536", "--val_files", VAL_SHARD)
    assert msg == (f"error: --val_tokens 65536 needs 65537 tokens but the val shards {VAL_SHARD!r} hold 36032;"
                   " lower --val_tokens")


def test_missing_shards(tmp_path):
    msg = start_up_error(tmp_path, "--val_files", str(tmp_path / "nothing_*.bin"))
    assert msg.startswith(f"error: no val shards match '{tmp_path / 'nothing_*.bin'}'"), msg


def test_layer_words_round_trip_to_the_records_rows():
    """--layers' words and the Layer rows say the same: the record's table through layer_words and back."""
    words = tuple(tg.layer_words(row) for row in tg.LAYERS)
    assert words[10] == "attn long ve gate dc offset from_h mudd" and words[6] == "skip"
    assert tg.layers_from_words(words) == tg.LAYERS
    args = tg.parse_args(["--layers", repr(words)])
    assert args.layers == tg.LAYERS
    assert tg.parse_args(["--layers", repr(words[:6] + ("skip",) + words[7:])]).layers == tg.LAYERS


# ----------------------------------------------------------------------------------------------
# The speedrun's functions check their arguments beside them: a bad call is one line
# ----------------------------------------------------------------------------------------------

def _sparse_optimizer(world_size=2):
    """One sharded_sparse Adam table of 8 rows, rank 0 of world_size in one process."""
    table = torch.nn.Parameter(torch.zeros(8, 4))
    return tg.NorMuonAdam({"table": table}, {"table": tg.ParamConfig(optimizer="adam", comms="sharded_sparse")},
                          scatter_order=["table"], work_order=["table"], comm=tg.SimulatedComm(world_size))


def _declare_twice():
    opt = _sparse_optimizer()
    opt.prepare_sparse("table", [1, 2], launch=True)
    opt.prepare_sparse("table", [3])


def _fp8_state():
    return tg.FP8MLPState(num_layers=2, hidden=32, dim=16)


BAD_CALLS = {
    "fp8 mlp input": (lambda: _fp8_state().mlp(0, torch.zeros(4, 8, dtype=torch.bfloat16),
                                                torch.zeros(32, 16, dtype=torch.bfloat16),
                                                torch.zeros(32, 16, dtype=torch.bfloat16)),
                      r"FP8MLPState.mlp: x must be \(T, 16\), w_up and w_down \(32, 16\), all bf16; got x \(4, 8\)"),
    "fp8 act scales": (lambda: _fp8_state().update_act_scales([torch.zeros(3)]),
                       "FP8MLPState.update_act_scales: post_maxima must hold 2 layers' maxima, got 1"),
    "fp8 quantize": (lambda: _fp8_state().quantize(torch.zeros(3, 32, 16), bootstrap=True),
                     r"FP8MLPState.quantize: mlp_bank must be \(>= 4, 32, 16\), got \(3, 32, 16\)"),
    "sparse label": (lambda: _sparse_optimizer().prepare_sparse("embed", [1]),
                     "prepare_sparse: 'embed' is not a parameter with comms='sharded_sparse'"),
    "sparse rows out of the table": (lambda: _sparse_optimizer().prepare_sparse("table", [2, 9], launch=True),
                                     r"prepare_sparse: row ids of 'table' must be in \[0, 8\); got 2..9"),
    "sparse rows after launch": (_declare_twice, "prepare_sparse: the row exchange of 'table' was already launched"),
    "after_update of an adam label": (lambda: tg.after_update(_sparse_optimizer(), {"table": print}).__enter__(),
                                      r"after_update: hooks\['table'\] needs a normuon label"),
    "untie untied": (lambda: _sparse_optimizer().untie(), r"NorMuonAdam.untie\(\): embedding and head are not tied"),
    "mask of a partial block": (lambda: tg.block_mask_indices(torch.zeros(100, dtype=torch.int64), 64),
                                "attention: sequence of 100 slots is not a multiple of the 128-token attention block"),
    "mask window on a device": (lambda: tg.block_mask_indices(torch.zeros(128, dtype=torch.int64),
                                                              torch.tensor(64, device="meta")),
                                "block_mask_indices: pass the window as a Python int"),
    "varlen mask from ids": (lambda: tg.attention_mask(torch.zeros(128, dtype=torch.int64), torch.tensor(64), 64, 1,
                                                       "varlen"),
                             "attention: varlen attention takes document starts, not ids"),
    "window of 0 blocks": (lambda: tg.GPT(tg.parse_args(["--preset", "test"])).set_windows(0, 3),
                           "set_windows: short window must be a block count >= 1, got 0"),
    "missing shard": (lambda: tg.read_shard(os.path.join(ROOT, "no_such_shard.bin")),
                      "no_such_shard.bin: cannot read shard"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_stop_with_one_line_naming_the_function(case):
    """Each argument check the first part of train_gpt.py calls in one line (its body below the fence):
    the function's name and what it needs, in one line, before any work."""
    call, message = BAD_CALLS[case]
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)
