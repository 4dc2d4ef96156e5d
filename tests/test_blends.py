"""Record #92's end-of-run weight blends (--weight_blends) on a CPU: their ticks and rates over #92's own
1,194 steps against the numbers its source gives, and a whole run's blend against a float64 loop written
here from #92's description. That 1 and 2 gloo ranks train alike with them is in test_training.py."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt as T  # noqa: E402

LABELS = ("lm_head", "embed", "vo_bank", "mlp_bank", "value_embeds", "qk_bank")


def ve_updated_92(step: int) -> bool:
    """Record #92's value-embedding cadence: odd steps, every fourth (step = 3 mod 4) from step 336."""
    return step % 2 == 1 and (step % 4 == 3 or step < 336)


def tick_log(total: int, ve_updated) -> dict[str, list[tuple[int, float]]]:
    """(step, rate) of every tick of each blend over a run of `total` steps."""
    blends = T.WeightBlends({label: torch.zeros(2) for label in LABELS}, total)
    log = {b.name: [] for b in T.BLENDS}
    for step in range(total):
        before = dict(blends.ticks)
        blends.tick(step, ve_updated(step))
        for b in T.BLENDS:
            if blends.ticks[b.name] != before[b.name]:
                window = blends.windows[b.name]
                log[b.name].append((step, T.BLEND_RATES[b.name](step, total, window, ve_updated(step))))
    return log


def test_ticks_and_rates_over_record_92s_1194_steps():
    """#92: TailEMA 150 ticks (step 896 at 2/299, odd steps 897-1,191 at 1 - (1 - 2/299)^2, step 1,193 at 2/299);
    the tail average 63 ticks from 945, every fourth step counted back from the last, at 4/53; the value-embedding
    average 62 ticks on its update steps at 4/53; the bank blend 76 ticks (step = 1 mod 4, and 1,192, 1,193) at 2/75."""
    log = tick_log(1194, ve_updated_92)
    assert {name: len(ticks) for name, ticks in log.items()} == {
        "tail_ema": 150, "tail_average": 63, "value_embed_average": 62, "bank_blend": 76}
    r = 2 / 299
    ema = log["tail_ema"]
    assert ema[0] == (896, pytest.approx(r)) and ema[-1] == (1193, pytest.approx(r))
    assert [s for s, _ in ema[1:-1]] == list(range(897, 1192, 2))
    assert all(rate == pytest.approx(1 - (1 - r) ** 2) for _, rate in ema[1:-1])
    assert [s for s, _ in log["tail_average"]] == list(range(945, 1194, 4))
    assert [s for s, _ in log["value_embed_average"]] == list(range(947, 1192, 4))
    assert [s for s, _ in log["bank_blend"]] == [*range(897, 1192, 4), 1192, 1193]
    for name, rate in (("tail_average", 4 / 53), ("value_embed_average", 4 / 53), ("bank_blend", 2 / 75)):
        assert all(got == pytest.approx(rate, rel=1e-12) for _, got in log[name]), name


def test_a_short_run_blends_over_its_own_tail():
    """Windows are fractions of the run: 78 steps (the CPU demo) tick over their last 19 and 16 steps."""
    log = tick_log(78, lambda step: step % 2 == 1)
    assert log["tail_ema"][0][0] == 78 - 19 and log["tail_average"][0][0] >= 78 - 16
    assert log["bank_blend"][-1][0] == 77 and all(0 < rate <= 1 for ticks in log.values() for _, rate in ticks)
    odd = tick_log(77, lambda step: step % 2 == 1)["tail_ema"]  # an odd length: its last (even) step ticks too
    assert odd[-2][0] == 75 and odd[-1] == (76, pytest.approx(2 / 20))


def blended64(trajectory: list[dict[str, torch.Tensor]], total: int, ve_updated) -> dict[str, torch.Tensor]:
    """#92's ships in float64 from the weights after every step: TailEMA (blend 0.65), the tail average (replaces
    vo and MLP), the value-embedding average (replaces), the bank blend (lerp 0.55, vo and MLP 0.3493) of the
    already averaged banks, each EMA seeded by its first tick; then embed, lm_head and the banks renormed."""
    def ema(labels, window, rate_of):
        out = {}
        for step, weights in enumerate(trajectory):
            rate = rate_of(step) if step >= total - window else None
            for label in labels if rate is not None else ():
                w = weights[label].double()
                out[label] = w.clone() if label not in out else out[label] + rate * (w - out[label])
        return out

    def ema_rate(step, r=2 / 75):
        if step % 2 == 0:
            return r if step == total - 74 else None
        return r if step == total - 1 else 1 - (1 - r) ** 2

    final = {label: w.double() for label, w in trajectory[-1].items()}
    norms = {label: final[label].norm() for label in ("embed", "lm_head", "mlp_bank", "qk_bank", "vo_bank")}
    tail = ema(("lm_head", "embed"), 74, ema_rate)                                  # round(298/1194 * 296)
    avg = ema(("vo_bank", "mlp_bank"), 62, lambda s: 2 / (0.102 * 62 + 1) if (total - 1 - s) % 4 == 0 else None)
    ve = ema(("value_embeds",), 62, lambda s: 2 / (0.102 * 62 + 1) if ve_updated(s) else None)
    bank = ema(("qk_bank", "vo_bank", "mlp_bank"), 74, lambda s: 2 / 19 if s % 4 == 1 or s >= total - 2 else None)
    out = dict(final)
    for label in tail:
        out[label] = out[label] + 0.65 * (tail[label] - out[label])
    out.update(avg)
    out.update(ve)
    for label, mix in (("qk_bank", 0.55), ("vo_bank", 0.3493), ("mlp_bank", 0.3493)):
        out[label] = out[label] + mix * (bank[label] - out[label])
    for label, norm in norms.items():
        out[label] = out[label] * norm / out[label].norm()
    return out


def test_a_run_ships_what_a_float64_loop_computes():
    total = 296  # windows of 74 and 62 steps
    torch.manual_seed(0)
    shapes = {"lm_head": (6, 10), "embed": (10, 6), "vo_bank": (4, 6, 6), "mlp_bank": (4, 12, 6),
              "qk_bank": (2, 8, 6), "value_embeds": (2, 10, 6)}
    params = {label: torch.randn(shape) for label, shape in shapes.items()}
    params["mlp_bank"] = params["mlp_bank"].bfloat16()  # a bf16 bank: the averages and the blend in fp32
    blends = T.WeightBlends(params, total)
    trajectory = []
    for step in range(total):
        for p in params.values():
            p.add_((torch.randn(p.shape) * 0.05 + 0.01).to(p.dtype))  # a drift and noise
        trajectory.append({label: p.clone() for label, p in params.items()})
        blends.tick(step, value_embeds_updated=step % 2 == 1)
    line = blends.ship()
    assert line == "weight blends shipped (ticks): tail_ema 38, tail_average 16, value_embed_average 31, bank_blend 20"
    want = blended64(trajectory, total, lambda s: s % 2 == 1)
    for label, p in params.items():
        tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(p.double(), want[label], rtol=tol, atol=tol, msg=label)
    # the blends moved every label away from its last weights (a test that sees them)
    for label, p in params.items():
        assert (p.double() - trajectory[-1][label].double()).abs().max() > 0.05, label
    assert blends.ticks == {b.name: 0 for b in T.BLENDS}  # shipped once; the averages are gone


def run(tmp_path, run_id: str, *flags) -> tuple[float, str, dict]:
    """train() on one CPU rank in this process (the test preset: 7 steps, the blends' window from step 5,
    checkpoints at steps 6 and 7): the final validation loss, the log and the last checkpoint's weights."""
    args = T.parse_args(["--preset", "test", "--weight_blends", "true", "--cpu_dtype", "fp32", "--compile", "false",
                         "--save_every", "6", "--val_loss_every", "0", "--run_id", run_id, "--log_dir", str(tmp_path / "logs"),
                         "--checkpoint_dir", str(tmp_path / "ckpt"), *flags])
    val = T.train(args, T.DistInfo(0, 1, 0, torch.device("cpu")))
    log = (tmp_path / "logs" / f"{run_id}.txt").read_text()
    return val, log, torch.load(tmp_path / "ckpt" / run_id / "step_000007" / "model.pt", weights_only=False)["model"]


def test_a_run_resumed_inside_the_window_blends_as_the_uninterrupted_one(tmp_path, monkeypatch, capsys):
    """Checkpoints hold the averages: a run resumed from step 6 (after the window's first ticks, at step 5)
    ships after as many ticks and ends with the same weights and validation loss as the run never stopped,
    its compile warm-up (run here on the eager model) giving back the averages it ticked; a checkpoint
    without them (an older script's) is refused in one line, before any step."""
    val, log, weights = run(tmp_path, "whole")
    ckpt = tmp_path / "ckpt" / "whole" / "step_000006"
    saved = torch.load(ckpt / "model.pt", weights_only=False)
    assert saved["blends"]["ticks"]["tail_ema"] == 1 and saved["blends"]["averages"]["tail_ema"]  # ticked at step 5
    monkeypatch.setattr(T, "compile_model", lambda model: model)  # the warm-up's steps without inductor
    capsys.readouterr()
    val_resumed, log_resumed, weights_resumed = run(tmp_path, "resumed", "--resume", str(ckpt), "--compile", "true")
    assert re.search(r"compile warm-up: [1-9]\d* steps", capsys.readouterr().out)
    shipped = "weight blends shipped (ticks): tail_ema 2, tail_average 1, value_embed_average 0, bank_blend 2\n"
    assert shipped in log and shipped in log_resumed
    for name, t in weights.items():
        assert torch.equal(weights_resumed[name], t), name
    assert val_resumed == val

    del saved["blends"]  # as an older script wrote it
    torch.save(saved, ckpt / "model.pt")
    with pytest.raises(SystemExit, match=r"^error: cannot resume from .*step_000006: step 6 is inside --weight_blends' "
                       r"window \(from step 5\) and the checkpoint holds no averages") as e:
        run(tmp_path, "refused", "--resume", str(ckpt))
    assert "\n" not in str(e.value)


def test_averages_of_another_run_are_refused_by_name_label_and_shape():
    """load_state_dict takes only averages this run's blends could have made: the same blends, each of its own
    labels at the parameter's shape (a checkpoint of another layout is refused by load_checkpoint in one line)."""
    params = {label: torch.zeros(3, 2) for label in LABELS}
    blends = T.WeightBlends(params, 100)
    for step in range(100):
        blends.tick(step, value_embeds_updated=True)
    state = blends.state_dict()
    fresh = T.WeightBlends(params, 100)
    fresh.load_state_dict(state)
    assert fresh.ticks == blends.ticks and all(torch.equal(fresh.averages[n][k], t)
                                               for n, a in blends.averages.items() for k, t in a.items())
    bad = {"averages": {**state["averages"], "tail_ema": {"lm_head": torch.zeros(2, 3)}}, "ticks": state["ticks"]}
    with pytest.raises(ValueError, match=r"^weight blend tail_ema: an average of lm_head \(2, 3\) does not fit$"):
        fresh.load_state_dict(bad)
    bad = {"averages": {**state["averages"], "tail_ema": {"qk_bank": torch.zeros(3, 2)}}, "ticks": state["ticks"]}
    with pytest.raises(ValueError, match=r"^weight blend tail_ema: an average of qk_bank \(3, 2\) does not fit$"):
        fresh.load_state_dict(bad)
    missing = {"averages": {k: v for k, v in state["averages"].items() if k != "bank_blend"}, "ticks": state["ticks"]}
    with pytest.raises(ValueError, match=r"^weight blends \['tail_average', 'tail_ema', 'value_embed_average'\], this run"):
        fresh.load_state_dict(missing)
