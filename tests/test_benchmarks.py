"""Benchmarks and ablation switches: every switch against an independent way of removing the same
component, the optimizer variants against hand-written updates, the benchmark arithmetic against
hand-computed values and the model figures of records/README.md, and a --smoke run of every benchmark script."""
import contextlib
import copy
import dataclasses
import glob
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "benchmarks"))

import step_budget  # noqa: E402
import step_timing  # noqa: E402
import stage_rise  # noqa: E402
import token_efficiency as te  # noqa: E402
import warm_python  # noqa: E402
from dist_utils import on_call  # noqa: E402

# The test preset with a small vocabulary: the switches do not involve the vocabulary, and the CPU
# cross-entropy over 50k logits would dominate the run time.
TEST = tg.parse_args(["--preset", "test", "--compile", "false", "--vocab_size", "1000", "--padded_vocab_size", "1024"])


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def batch(T=256, starts=(0, 40, 130, 200), seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TEST.vocab_size, (T + 1,), generator=g)
    cu = torch.tensor(list(starts) + [T] * (tg.max_docs_for(T) + 1 - len(starts)), dtype=torch.int32)
    inputs = tokens[:-1].to(torch.int32)
    return inputs, tokens[1:].clone(), cu, tg.bigram_hash(inputs, TEST.ngram_rows)


@torch.no_grad()
def randomized(args, seed=0):
    """A model whose every component contributes (the zero inits would hide most of them)."""
    torch.manual_seed(seed)
    model = tg.GPT(args)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bank"):
            p.copy_((torch.randn(p.shape, generator=g) / math.sqrt(args.model_dim)).to(p.dtype))
        elif name == "scalars" or name.endswith("lambdas"):
            p.copy_(0.3 + 0.7 * torch.rand(p.shape, generator=g))
        else:
            p.copy_((0.5 * torch.randn(p.shape, generator=g)).to(p.dtype))
    return model


def loss_of(model, mtp=(1.0, 0.5, 0.25)):
    inputs, targets, cu, bigrams = batch()
    with torch.no_grad():
        return float(model(inputs, targets, cu, bigrams, mtp_weights=torch.tensor(mtp), loss_scale=1 / 256)[0])


# ---- model switches: each equals another, independent way of removing the component ---------------

def _zero_smear(m):
    m.scalars[2 * m.args.num_layers] = 0.0


def _zero_post_loop_mudd(m):
    m.mudd_w2[1].zero_()
    m.mudd_b2[1].zero_()


def _zero_bigram(m):
    m.bigram_embed.zero_()


def _zero_value_embeds(m):
    m.value_embeds.zero_()


def _unsigned_bigram(m):
    m.bigram_sign_table.fill_(1.0)


def _constant_mudd(m):  # second layers zero: every coefficient is its bias
    m.mudd_w2.zero_()
    m.mudd_gate_w2.zero_()


def _zero_skip_gate(m):
    start, _ = m.gate_layout[1]["skip", 2]
    m.mudd_gate_w2[1, start].zero_()
    m.mudd_gate_b2[1, start] = 0.0


def _words(edit):  # the test table rewritten as --layers words: an independent route to the ablated rows
    return {"layers": tg.layers_from_words(tuple(edit(tg.layer_words(row).split()) for row in TEST.layers))}


def _without(word):  # the test table with a word dropped from every row
    return _words(lambda words: " ".join(w for w in words if w != word))


def _coefficients(kind, value):  # every MUDD gate coefficient of this kind forced to `value`
    def edit(m):
        gate = m._mudd_gate

        def forced(k, x):
            out = gate(k, x).clone()
            for (name, _), (start, width) in m.gate_layout[k].items():
                if name == kind:
                    out[:, start: start + width] = value
            return out
        m._mudd_gate = forced
    return edit


# Switches outside the rows: the model with the switch off equals the full model with the component
# zeroed. Row ablations (train_gpt.ABLATIONS) build another model (the MUDD gates' layout follows
# the rows): they equal the table with the words dropped, through --layers' parser.
EQUIVALENTS = {
    "smear": (_zero_smear, {}),
    "backout": (_zero_post_loop_mudd, {}),
    "bigram_embed": (_zero_bigram, {}),
    "bigram_signs": (_unsigned_bigram, {}),
    "value_embeds": (_zero_value_embeds, {}),
    "mudd": (_constant_mudd, {}),
    "unet_skip": (_zero_skip_gate, {}),
    "paired_heads": (None, _words(lambda words: " ".join("attn" if w == "paired" else w for w in words))),
    "xsa": (None, _without("xsa")),
    "attn_gates": (None, _without("gate")),
    "dc": (None, _without("dc")),
    "key_offset": (None, _without("offset")),
    "from_h": (None, _without("from_h")),
}


@pytest.mark.parametrize("switch", sorted(EQUIVALENTS))
def test_switch_equals_removing_the_component(switch):
    edit, arg_change = EQUIVALENTS[switch]
    full = randomized(TEST)
    off_args = tg.ablated(TEST, [switch]) if switch in tg.ABLATIONS else dataclasses.replace(TEST, **{switch: False})
    off = randomized(off_args)
    reference = randomized(dataclasses.replace(TEST, **arg_change))
    if edit:
        with torch.no_grad():
            edit(reference)
    l_full, l_off, l_ref = loss_of(full), loss_of(off), loss_of(reference)
    assert abs(l_full - l_off) > 1e-4, f"--{switch} false changed nothing"  # 10x the equality tolerance
    assert l_off == pytest.approx(l_ref, abs=1e-5)


def test_switches_are_read_where_they_act_not_bound_on_the_model():
    """A switched-off component is a branch of GPT's own method (the switch read where it acts): no model
    carries a method of its own, whichever switch is off, and the file swaps no method on an instance."""
    switches = ("value_embeds", "bigram_signs", "bigram_embed", "smear", "unet_skip", "backout", "mudd")
    with torch.device("meta"):
        for switch in (None, *switches):
            model = tg.GPT(dataclasses.replace(TEST, **{switch: False}) if switch else TEST)
            assert not [k for k, v in vars(model).items() if callable(v) and not isinstance(v, torch.nn.Module)], switch
    source = open(tg.__file__).read()
    assert "MethodType" not in source and "setattr(model" not in source


def test_row_ablations_switch_the_feature_off_in_every_row():
    """Row ablations against the rows spelt out: no row keeps the feature, nothing else changes."""
    feature = {"xsa": ("xsa", False), "attn_gates": ("gate", False), "dc": ("dc", False),
               "key_offset": ("key_offset", False), "from_h": ("input", "x")}
    for name, (field, off) in feature.items():
        rows = tg.ablated(tg.Hyperparameters(), [name]).layers
        assert any(getattr(r, field) != off for r in tg.LAYERS), name  # the record has the feature
        assert all(getattr(r, field) == off for r in rows), name
        assert [dataclasses.replace(r, **{field: off}) for r in tg.LAYERS] == list(rows)
    rows = tg.ablated(tg.Hyperparameters(), ["paired_heads"]).layers
    assert [r.attention for r in rows] == ["plain"] * 6 + ["none"] + ["plain"] * 4


def test_only_picks_ablation_rows_by_substring_or_by_a_whole_name_with_a_comma():
    names = [name for name, _ in te.ABLATIONS]
    picked = lambda only: [names[i] for i in te.selected_ablations(only)]
    assert picked("") == names
    assert picked("dc,xsa") == ["full recipe", "XSA", "DC"]  # in the table's order
    assert picked("full recipe") == ["full recipe"]
    # a whole name holding a comma is one row, not its two halves (the first half names all five rates)
    assert picked("NorMuon -> AdamW on the matrices, bank lr x0.25") == \
        ["full recipe", "NorMuon -> AdamW on the matrices, bank lr x0.25"]
    assert len(picked("NorMuon -> AdamW on the matrices")) == 6
    assert picked("x0.0625") == ["full recipe", "NorMuon -> AdamW on the matrices, bank lr x0.0625"]
    with pytest.raises(SystemExit, match=r"--only 'mpt' names no ablation row; the rows: NorMuon -> Muon"):
        te.selected_ablations("dc,mpt")


def test_mtp_ablation_scores_the_next_token_only():
    off_args = tg.ablated(TEST, ["mtp"])
    assert {tg.plan_step(off_args, s).mtp_weights for s in range(tg.total_steps(off_args))} == {(1.0,)}
    off, full = randomized(off_args), randomized(TEST)
    assert loss_of(off, (1.0,)) == pytest.approx(loss_of(full, (1.0, 0.0, 0.0)), abs=1e-5)
    assert abs(loss_of(full, (1.0, 0.5, 0.25)) - loss_of(full, (1.0, 0.0, 0.0))) > 1e-2


def test_window_schedule_ablation_fixes_the_last_stage_windows_without_yarn():
    args = tg.ablated(TEST, ["window_schedule"])
    model = tg.GPT(args)
    bs = TEST.window_block_size
    short, long = TEST.stages[2].windows
    total = tg.total_steps(args)
    assert {tg.plan_step(args, s).windows for s in range(total)} == {(short, long)}
    assert args.windows_init == args.final_val_windows == (short, long)
    for windows in ((*args.windows_init, None), (*tg.plan_step(args, total - 1).windows, None),
                    (*args.final_val_windows, tg.plan_step(args, total - 1).windows[1])):  # as train() calls it
        model.set_windows(*windows)
        assert model.windows.tolist() == [short * bs, long * bs]
        torch.testing.assert_close(model.rotary_freq, tg.rotary_base_frequencies(TEST.head_dim), rtol=0, atol=0)
        assert float(model.attn_scale) == pytest.approx(TEST.attn_scale * math.sqrt(128 / TEST.head_dim))
    scheduled = tg.GPT(TEST)
    scheduled.set_windows(short, long)
    assert not torch.equal(scheduled.rotary_freq, model.rotary_freq)  # the schedule rescales (YaRN)


# ---- optimizer switches --------------------------------------------------------------------------

def _one_step(args, do_adam, seed=0):
    model = randomized(args, seed)
    g = torch.Generator().manual_seed(seed + 1)
    before = {k: v.detach().double().clone() for k, v in model.named_parameters()}
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = grads[name].clone()
    opt = tg.build_optimizer(args, model, torch.device("cpu"))
    opt.step(do_adam, lr_scale=1.0, momentum=0.9)
    after = {label: tg._master_fp32(opt.placements[label].view(), opt.state[label].get("mantissa")).double()
             .reshape(opt.placements[label].param.shape) if opt.state[label] else opt.placements[label].param.detach().double()
             for label in opt.placements}
    model.opt = opt  # for tests that look at optimizer state
    return model, before, grads, after


def test_muon_is_normuon_without_variance_reduction():
    args = dataclasses.replace(TEST, matrix_optimizer="muon")
    model, before, grads, after = _one_step(args, do_adam=False)
    m, lr, wd = torch.tensor(0.9), args.muon_lr, args.muon_wd
    g = grads["mlp_bank"].float()                       # (8, 256, 64): tall matrices
    buf = torch.zeros_like(g).lerp_(g, 1 - m)           # momentum buffer starts at zero
    O = tg.polar_express(g.lerp(buf, m)).double()       # Nesterov look-ahead, then orthogonalize
    roles = model.bank_roles["mlp_bank"]
    mult = torch.tensor([2.0 * (2.0 if r.startswith("down.") else 1.0) for r in roles], dtype=torch.float64)
    p = before["mlp_bank"]                              # shape factor sqrt(256/64) = 2, down-projections x2
    eff = lr * mult.view(-1, 1, 1)
    expected = p - eff * O - lr * wd * eff * (O * p >= 0) * p  # decay wd * lr * lr_eff
    torch.testing.assert_close(after["mlp_bank"], expected, rtol=0, atol=2e-6)
    # NorMuon's per-neuron scaling moves the update well away from that reference
    _, _, _, normuon = _one_step(TEST, do_adam=False)
    assert (normuon["mlp_bank"] - expected).abs().max() > 1e-3


def test_adamw_puts_the_banks_on_adam():
    args = dataclasses.replace(TEST, matrix_optimizer="adamw")
    configs = tg.optimizer_configs(args, tg.GPT(args))
    assert all(configs[b].optimizer == "adam" for b in ("qk_bank", "vo_bank", "mlp_bank"))
    model, before, grads, after = _one_step(args, do_adam=True)
    lr = args.adam_lr
    bank_lr = lr * 0.25  # --adamw_bank_lr_mul's default
    decay = tg.ADAMW_BANK_DECAY * bank_lr  # the decoupled decay per step at the base lr
    p, g = before["mlp_bank"], grads["mlp_bank"].double()
    update = bank_lr * g / (g.abs() + 1e-10 / math.sqrt(1 - 0.95))  # first Adam step, eps on the raw root
    expected = (p - update - decay * (update * p > 0) * p).to(torch.bfloat16).double()  # rounded into bf16
    got = after["mlp_bank"]
    assert (got == expected).double().mean() > 0.99  # fp32 vs float64 arithmetic may flip a rare tie
    assert ((got - expected).abs() <= expected.abs() * 2.0 ** -7).all()
    # the banks step on every step (the other Adam parameters on odd steps only), at the lr asked for
    _, before0, _, after0 = _one_step(args, do_adam=False)
    torch.testing.assert_close(after0["mlp_bank"], after["mlp_bank"], rtol=0, atol=0)
    torch.testing.assert_close(after0["embed"], before0["embed"], rtol=0, atol=0)
    _, before2, _, after2 = _one_step(dataclasses.replace(args, adamw_bank_lr_mul=0.5), do_adam=False)
    step2, step1 = after2["mlp_bank"] - before2["mlp_bank"], after["mlp_bank"] - before["mlp_bank"]
    assert step2.abs().mean() == pytest.approx(2 * step1.abs().mean(), rel=0.02)


@pytest.mark.parametrize("switch,labels", [("value_embeds", ("value_embeds", "ve_gate_bank")),
                                           ("bigram_embed", ("bigram_embed",)), ("smear", ("smear_gate",)),
                                           ("mudd", ("mudd_w1", "mudd_w2", "mudd_gate_w1", "mudd_gate_w2"))])
def test_switched_off_parameters_stay_frozen(switch, labels):
    args = dataclasses.replace(TEST, **{switch: False})
    _, before, _, after = _one_step(args, do_adam=True)
    for label in labels:
        torch.testing.assert_close(after[label], before[label], rtol=0, atol=0)
    full, before_full, _, after_full = _one_step(TEST, do_adam=True)
    for label in labels:
        if label == "smear_gate":  # lr 8e-5 is below half a bf16 step of its values: Adam's rounding keeps
            assert full.opt.state[label]["exp_avg"].abs().sum() > 0  # them (as in the record); the state moves
        else:
            assert not torch.equal(after_full[label], before_full[label]), label


def test_bad_matrix_optimizer_names_the_flag():
    args = dataclasses.replace(TEST, matrix_optimizer="sgd")
    with pytest.raises(ValueError, match="--matrix_optimizer 'sgd'"):
        tg.build_optimizer(args, tg.GPT(args), torch.device("cpu"))


def test_every_ablation_builds_a_model_and_optimizer(tmp_path):
    def sized(overrides=None, edit=None):
        return te.recipe_args("test", "", "", 3072, 0, 1024, torch.device("cpu"), overrides, str(tmp_path), edit)

    base = sized()
    by_row_edit = {name: sized(edit=lambda a, n=name: tg.ablated(a, [n])) for name in tg.ABLATIONS}
    seen = set()
    for name, spec in te.ABLATIONS:
        overrides, edit = ({}, spec) if callable(spec) else (spec, None)
        args = sized(overrides, edit)
        seen.update(f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(base, f.name))
        model = tg.GPT(args)
        tg.build_optimizer(args, model, torch.device("cpu"))
        if edit is not None:
            seen.update(row_edit for row_edit, ref in by_row_edit.items() if args == ref)
    switches = ("matrix_optimizer", "value_embeds", "bigram_embed", "bigram_signs", "smear", "unet_skip", "backout",
                "mudd", "orthogonalizer", "stages", "layers", *tg.ABLATIONS)
    assert set(switches) <= seen


# ---- benchmark arithmetic ------------------------------------------------------------------------

def test_tokens_to_reach_and_ratio_by_hand():
    classic = [(0, 10.0), (100, 6.0), (200, 5.0), (300, 5.5)]   # best 5.0 at 200 tokens
    recipe = [(0, 10.0), (50, 6.0), (100, 4.0)]                  # crosses 5.0 half way from 50 to 100
    assert te.best_point(classic) == (200, 5.0)
    assert te.tokens_to_reach(recipe, 5.0) == pytest.approx(75.0)
    assert te.efficiency_ratio(recipe, classic) == pytest.approx(75.0 / 200.0)
    assert te.tokens_to_reach(recipe, 3.0) is None
    assert te.efficiency_ratio([(0, 10.0), (100, 7.0)], classic) is None
    assert te.loss_at(classic, 150) == pytest.approx(5.5)


def test_ratio_of_seed_mean_curves_by_hand():
    """Two seeds. Classic: 10 -> 6 -> 4 and 10 -> 8 -> 6 at 0, 100, 200 tokens: mean 10, 7, 5, best 5 at
    200. Recipe: 10 -> 4 and 10 -> 6 at 0, 100 (the other seed also at 50: 8): mean at 50 is
    (7 + 8) / 2 = 7.5, at 100 it is 5, so the mean recipe reaches 5 at 100 tokens: ratio 0.5."""
    classic = [[(0, 10.0), (100, 6.0), (200, 4.0)], [(0, 10.0), (100, 8.0), (200, 6.0)]]
    recipe = [[(0, 10.0), (100, 4.0)], [(0, 10.0), (50, 8.0), (100, 6.0)]]
    assert te.mean_curve(recipe) == [(0, 10.0), (50, 7.5), (100, 5.0)]
    assert te.mean_curve(classic) == [(0, 10.0), (100, 7.0), (200, 5.0)]
    ratio, boot = te.mean_curve_ratio(recipe, classic)
    assert ratio == pytest.approx(0.5)
    # resampling both seeds alike: {0, 0} gives 4 @ 200 and the recipe reaches it at 100 (0.5); {1, 1}
    # gives 6 @ 200, reached at 100 (0.5); {0, 1} is the full mean (0.5)
    assert len(boot) == 1000 and all(b == pytest.approx(0.5) for b in boot)
    # seed 1 slower (8 at 100, 6 at 200): the mean curve stops at the shorter seed's 100 tokens, where it
    # is (4 + 8) / 2 = 6, so it never reaches 5
    slower = [[(0, 10.0), (100, 4.0)], [(0, 10.0), (200, 6.0)]]
    assert te.mean_curve(slower) == [(0, 10.0), (100, 6.0)]
    assert te.mean_curve_ratio(slower, classic, resamples=0) == (None, [])


def test_search_edges_name_the_axes_to_extend():
    def run(lr, batch, seq):
        return {"classic_lr": lr, "classic_batch_tokens": batch, "classic_seq_len": seq}

    def sides(lines):  # ["lr only", ...]: each flagged axis and where the winner sits on it
        return [line.split("the winner's ")[1].split(" ")[0] + " " + line.split(" is the ")[1].split(" ")[0]
                for line in lines]
    grid = [run(lr, b, s) for lr in (0.001, 0.002, 0.004) for b in (2048, 4096, 8192) for s in (256, 1024)]
    inside = next(r for r in grid if r["classic_lr"] == 0.002 and r["classic_batch_tokens"] == 4096
                  and r["classic_seq_len"] == 1024)
    lines = te.search_edges(grid, inside)
    assert lines == ["the winner's seq_len 1,024 is the largest value searched at lr 0.002, batch_tokens 4,096 (256, 1,024): "
                     "extend --search_seq past it"]
    corner = grid[0]  # lr 0.001, batch 2048, context 256: the smallest of all three
    assert sides(te.search_edges(grid, corner)) == ["lr smallest", "batch_tokens smallest", "seq_len smallest"]
    # a cross through the winner (0.002, 4,096, 512): inside on every axis
    cross = [run(0.002, b, 512) for b in (2048, 4096, 8192)] + [run(lr, 4096, 512) for lr in (0.001, 0.004)] + \
        [run(0.002, 4096, s) for s in (256, 1024)]
    assert te.search_edges(cross, cross[1]) == ["the winner is inside the searched grid on every axis"]
    # the same rates and contexts tried only at other settings do not count: lr and context were never
    # varied at the winner's (4,096, 512), so both are "only" there, though both were searched elsewhere
    middle = [run(0.002, b, 512) for b in (2048, 4096, 8192)] + [run(lr, 4096, s) for lr in (0.001, 0.004)
                                                                   for s in (256, 1024)]
    assert sides(te.search_edges(middle, middle[1])) == ["lr only", "seq_len only"]
    assert te.search_edges([run(0.002, 4096, 512)], run(0.002, 4096, 512))[0] == (
        "the winner's lr 0.002 is the only value searched at batch_tokens 4,096, seq_len 512: extend --search_lr past it")
    # one window a step (batch == context): no smaller batch, no longer context; the diagonal stands in
    win = run(0.0015, 1024, 1024)
    rows = [win, run(0.0015, 2048, 1024), run(0.00075, 1024, 1024), run(0.003, 1024, 1024), run(0.0015, 1024, 512)]
    assert te.search_edges(rows, win) == [
        "the winner's batch_tokens 1,024 is the smallest value searched at lr 0.0015, seq_len 1,024 (1,024, 2,048), "
        "and one window a step: extend --search_batch and --search_seq below it together (batch = context)",
        "the winner's seq_len 1,024 is the largest value searched at lr 0.0015, batch_tokens 1,024 (512, 1,024), "
        "and one window a step: extend --search_batch and --search_seq above it together (batch = context)"]
    rows += [run(0.0015, 512, 512)]  # the diagonal below: the batch axis is done
    assert sides(te.search_edges(rows, win)) == ["seq_len largest"]
    rows += [run(0.003, 2048, 2048)]  # above, but at another lr: does not count
    assert sides(te.search_edges(rows, win)) == ["seq_len largest"]
    rows += [run(0.0015, 2048, 2048)]
    assert te.search_edges(rows, win) == ["the winner is inside the searched grid on every axis"]
    # the recipe's cross as in records/token_efficiency_sympy_12M_tune: NorMuon 0.0115 was varied only at
    # Adam 0.008, so at the winner's Adam 0.016 it is the only NorMuon rate
    rs = [{"recipe_muon_lr": m, "recipe_adam_lr": a} for m, a in
          ((0.00575, 0.008), (0.0115, 0.008), (0.023, 0.008), (0.0115, 0.016))]
    assert te.search_edges(rs, rs[3], te.RECIPE_SEARCH_AXES) == [
        "the winner's muon_lr 0.0115 is the only value searched at adam_lr 0.016: extend --search_muon_lr past it",
        "the winner's adam_lr 0.016 is the largest value searched at muon_lr 0.0115 (0.008, 0.016): extend "
        "--search_adam_lr past it"]


def saved_classic(lr, curve):
    """A classic search point as --load reads it from its JSON (the fields the tables use)."""
    return {"classic_lr": lr, "classic_batch_tokens": 64, "classic_seq_len": 32, "seed": 0, "curve": curve}


def saved_rsearch(muon_lr, curve):
    """A recipe search point (--run recipe_search) as --load reads it."""
    return {"recipe_muon_lr": muon_lr, "recipe_adam_lr": 0.008, "seed": 0, "curve": curve}


def test_a_one_sided_folder_says_why_it_has_no_ratio():
    """A folder of one side's runs names why --load states no ratio there: a search (more than one
    classic configuration, or the recipe's rsearch_ runs) or the tuning split is a tuning folder; a
    scored folder whose other side has not been run yet says so, as does a folder of ablations."""
    def classic(lr, val_set="even", seed=0):
        return {"classic_lr": lr, "classic_batch_tokens": 2048, "classic_seq_len": 128, "val_set": val_set, "seed": seed}

    def line(runs, ablations=False):
        return te.one_side_line(runs, ablations).split("(")[1].split(")")[0]

    assert line({"classic_lr0.003_s0": classic(0.003), "classic_lr0.006_s0": classic(0.006)}) == "classic runs: a tuning folder"
    assert line({"classic_lr0.003_s0": classic(0.003, "tune")}) == "classic runs: a tuning folder"
    assert line({"classic_lr0.003_s0": classic(0.003), "classic_lr0.003_s1": classic(0.003, seed=1)}) == \
        "classic runs: no recipe run saved here yet"  # the scored split's seeds of one winner
    assert line({"rsearch_m0.01_a0.01_s0": {"val_set": "even"}}) == "recipe runs: a tuning folder"
    assert line({"recipe_s0": {"val_set": "tune"}}) == "recipe runs: a tuning folder"
    assert line({"recipe_s0": {"val_set": "even"}}) == "recipe runs: no classic run saved here yet"
    assert line({"recipe_s0": {}, "ablate_xsa_s0": {}}, ablations=True) == "recipe runs and ablations"
    assert te.one_side_line({"recipe_s0": {}}, False) == "one side only (recipe runs: no classic run saved here yet): no comparison, no ratio"


def test_a_scored_folder_waiting_for_the_other_side_lists_its_seeds(tmp_path, capsys):
    """--load on the scored split's folder while one side's seeds are run: per seed, its best val loss, the
    tokens it was first reached at (the earliest of equal losses) and its bigram floor, then the mean and
    sample std over the seeds; a single seed has no spread yet, and a tuning folder lists no seeds."""
    meta = {"tokens": 300, "val_tokens": 64, "preset": "test", "train": "t", "val": "v", "val_set": "even"}
    floor = {"unigram": 9.0, "bigram": 3.2, "bigram_weight": 0.5, "train_tokens": 300}
    te.save_curve(str(tmp_path), "recipe_s0", [(0, 10.0), (100, 3.0), (200, 2.5), (300, 2.5)], {**meta, "seed": 0, "floor": floor})
    runs = te.load_runs(str(tmp_path), None)
    floors = te.folder_floors(str(tmp_path), runs)
    assert te.one_side_seeds(runs, floors).splitlines()[1:] == ["   0   2.5000 @      200       3.2000",
                                                               "recipe best val: 2.5000 (1 seed: no spread yet)"]
    te.save_curve(str(tmp_path), "recipe_s1", [(0, 10.0), (100, 2.9), (200, 3.1), (300, 3.0)],
                  {**meta, "seed": 1, "floor": {**floor, "bigram": 3.3}})
    runs = te.load_runs(str(tmp_path), None)
    te.report(str(tmp_path), None, plot=False)
    out = capsys.readouterr().out
    assert "one side only (recipe runs: no classic run saved here yet)" in out
    # bests 2.5 and 2.9: mean 2.7, sample std sqrt(2 * 0.2 ** 2 / 1) = 0.2828
    assert out.endswith("   0   2.5000 @      200       3.2000\n   1   2.9000 @      100       3.3000\n"
                        "recipe best val: mean 2.7000, std 0.2828, range 2.5000 .. 2.9000 (2 seeds)\n")
    assert te.one_side_seeds({n: {**r, "val_set": "tune"} for n, r in runs.items()}, floors) == ""


def test_searches_preview_by_hand():
    """A tuning folder with both searches: the recipe search's winner (lowest best) against the classic
    search's winner. Classic winner: best 2.0 at 400 tokens (the other configuration's best is 2.5). Recipe
    winner (best 1.0): 3.0 at 100, 1.5 at 200, so it reaches 2.0 a third of the way: 100 + 100 * 1.0 / 1.5."""
    runs = {"classic_a_s0": saved_classic(0.001, [(0, 9.0), (200, 3.0), (400, 2.5)]),
            "classic_b_s0": saved_classic(0.002, [(0, 9.0), (200, 2.8), (400, 2.0), (600, 2.1)]),
            "rsearch_m0.01_a0.008_s0": saved_rsearch(0.01, [(0, 9.0), (100, 3.0), (200, 1.5), (300, 1.0)]),
            "rsearch_m0.02_a0.008_s0": saved_rsearch(0.02, [(0, 9.0), (100, 2.0), (300, 1.2)])}
    floor = {"unigram": 5.0, "bigram": 2.4, "bigram_weight": 0.9, "train_tokens": 600}
    line = te.searches_preview(runs, te.Floors({0: floor}, "here"))
    reach = 100 + 100 * 1.0 / 1.5
    assert "(NorMuon 0.01, Adam 0.008)" in line
    assert f"reaches the classic's best 2.0000 at {reach:,.0f} tokens, {reach / 400:.4f} of the classic's 400" in line
    # the same floor rule as the ratio: a classic best not 0.3 below the bigram gives no preview figure
    refused = te.searches_preview(runs, te.Floors({0: {**floor, "bigram": 2.2}}, "here"))
    assert "not stated" in refused and "2.0000" in refused and "reaches" not in refused
    slow = {**runs, "rsearch_m0.01_a0.008_s0": saved_rsearch(0.01, [(0, 9.0), (300, 1.9)]),
            "rsearch_m0.02_a0.008_s0": saved_rsearch(0.02, [(0, 9.0), (300, 2.1)])}
    assert te.searches_preview(slow, te.Floors({0: floor}, "here")).endswith(
        "(NorMuon 0.01, Adam 0.008) reaches the classic's best 2.0000 at 296 tokens, 0.7394 of the classic's 400")  # 300 * 7 / 7.1
    assert "does not reach the classic's best 2.0000 (400 tokens)" in te.searches_preview(
        {**runs, "rsearch_m0.01_a0.008_s0": saved_rsearch(0.01, [(0, 9.0), (300, 2.05)]),
         "rsearch_m0.02_a0.008_s0": saved_rsearch(0.02, [(0, 9.0), (300, 2.2)])}, te.Floors({0: floor}, "here"))
    assert te.searches_preview({k: v for k, v in runs.items() if k.startswith("classic_")}, te.Floors({}, "x")) == ""


def test_floor_margin_of_a_classic_folder_by_hand():
    """A folder of classic runs alone says how far its best seed-0 run is from the bigram and from the 0.3
    a ratio needs: winner best 2.0 (the other's 2.5); bigram 2.1: 0.100 below it, needs 1.8, 0.200 more;
    bigram 1.9: 0.100 above, 0.400 more; bigram 2.4: needs 2.1, cleared by 0.100; no floor: nothing."""
    runs = {"classic_a_s0": saved_classic(0.001, [(0, 9.0), (200, 3.0), (400, 2.5)]),
            "classic_b_s0": saved_classic(0.002, [(0, 9.0), (200, 2.8), (400, 2.0), (600, 2.1)])}
    floor = {"unigram": 5.0, "bigram_weight": 0.9, "train_tokens": 600}
    margin = {b: te.floor_margin(runs, te.Floors({0: {**floor, "bigram": b}}, "here")) for b in (2.1, 1.9, 2.4)}
    assert margin[2.1] == ("the classic's best 2.0000 (seed 0) is 0.100 below the interpolated bigram's 2.1000; "
                           "a ratio needs 1.8000 or below (0.3 below it): 0.200 more")
    assert margin[1.9].startswith("the classic's best 2.0000 (seed 0) is 0.100 above the interpolated bigram's 1.9000;")
    assert margin[1.9].endswith("a ratio needs 1.6000 or below (0.3 below it): 0.400 more")
    assert margin[2.4].endswith("a ratio needs 2.1000 or below (0.3 below it): cleared by 0.100")
    assert te.floor_margin(runs, te.Floors({}, "not known")) == ""


def test_curves_plot_draws_every_saved_run_with_each_search_winner_marked(tmp_path):
    """curves.png has a line for every run of the folder: the compared recipe runs, both searches'
    winners (classic_b: best 2.0; rsearch_m0.02: best 1.1, by hand) in colour, the other points faint."""
    runs = {"classic_a_s0": saved_classic(0.001, [(0, 9.0), (400, 2.5)]),
            "classic_b_s0": saved_classic(0.002, [(0, 9.0), (400, 2.0), (600, 2.1)]),
            "rsearch_m0.01_a0.008_s0": saved_rsearch(0.01, [(0, 9.0), (300, 1.2)]),
            "rsearch_m0.02_a0.008_s0": saved_rsearch(0.02, [(0, 9.0), (200, 1.1), (300, 1.3)]),
            "rsearch_m0.04_a0.008_s0": saved_rsearch(0.04, [(0, 9.0), (300, 1.5)]),
            "recipe_s0": {"seed": 0, "curve": [(0, 9.0), (300, 1.0)]}}
    labels = {n: name for n, (name, _) in te.curve_styles(runs).items()}
    assert labels == {"classic_a_s0": "classic, other search points", "classic_b_s0": "classic (search winner)",
                      "rsearch_m0.01_a0.008_s0": "recipe, other search points",
                      "rsearch_m0.02_a0.008_s0": "recipe (search winner)",
                      "rsearch_m0.04_a0.008_s0": "recipe, other search points", "recipe_s0": "recipe"}
    out = tmp_path / "curves.png"
    te.plot_curves(runs, str(out), "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png.tmp.png").exists()


def test_schedule_is_sized_to_the_token_budget():
    demo = dataclasses.replace(tg.Hyperparameters(), **tg.PRESETS["demo"])
    for budget in (200_000, 2_000_000):
        args = te.sized_for_tokens(demo, budget)
        total = sum(te.schedule_tokens(args))
        assert abs(total - budget) <= max(row.batch_tokens for row in demo.stages)
        assert total == sum(tg.plan_step(args, s).batch_tokens for s in range(tg.total_steps(args)))
    flat = te.constant_batch(demo)
    assert flat * 3 == sum(row.batch_tokens for row in demo.stages[:3]) and flat % (128 * demo.micro_batches) == 0


def test_classic_model_is_gpt2():
    c = te.ClassicConfig(vocab_size=512, seq_len=32, num_layers=2, model_dim=32, num_heads=4, mlp_hidden=128)
    model = te.ClassicGPT(c)
    D, M, L = c.model_dim, c.mlp_hidden, c.num_layers
    per_layer = (3 * D * D + 3 * D) + (D * D + D) + (D * M + M) + (M * D + D) + 4 * D
    assert sum(p.numel() for p in model.parameters()) == c.vocab_size * D + c.seq_len * D + L * per_layer + 2 * D
    idx = torch.randint(0, c.vocab_size, (2, c.seq_len))
    # at init the tied head gives near-uniform predictions: loss ~ ln(vocab)
    targets = torch.randint(0, c.vocab_size, (2, c.seq_len))
    with torch.no_grad():
        init_loss = float(model(idx, targets))
    assert init_loss == pytest.approx(math.log(c.vocab_size), abs=0.05)
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % c.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])           # causal: the future is invisible
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    assert te.classic_lr(c, 0, 100) == pytest.approx(c.lr / 5)  # 5 warm-up steps
    assert te.classic_lr(c, 4, 100) == pytest.approx(c.lr)
    assert te.classic_lr(c, 99, 100) == pytest.approx(c.lr * c.min_lr_frac)
    assert te.classic_lr(c, 52, 100) == pytest.approx(c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5))


def killed():
    raise KeyboardInterrupt


def dies_on_call(fn, n: int):
    """fn, except that its n-th call raises KeyboardInterrupt (a run killed there)."""
    return on_call(fn, n, killed)


def classic_shards(tmp_path):
    motif = np.random.default_rng(0).integers(0, 500, 50)  # a repeated motif: something to learn in a few steps
    tg.write_shard(str(tmp_path / "train.bin"), np.tile(motif, 60))
    tg.write_shard(str(tmp_path / "val.bin"), np.tile(motif, 6))
    return str(tmp_path / "train.bin"), str(tmp_path / "val.bin")


def test_an_interrupted_classic_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Killed mid-step, a classic run with a state file continues from its last save and gives the same
    curve, to the bit, as the run that was never stopped (weights, AdamW moments and stream position all
    restored); a state of another configuration is refused with one line."""
    train, val = classic_shards(tmp_path)
    c = te.ClassicConfig(vocab_size=512, seq_len=32, num_layers=2, model_dim=32, num_heads=2, mlp_hidden=64,
                         lr=1e-2, batch_tokens=64)
    run = lambda state="", cfg=c: te.run_classic(cfg, train, val, 64 * 12, 4, 128, torch.device("cpu"), 3,  # noqa: E731
                                                 state, {"commit": "abc"})
    reference = run()["curve"]
    assert len(reference) == 5 and reference[-1][1] < reference[0][1] - 0.1  # it learns: 12 steps, 4 evals

    clip = torch.nn.utils.clip_grad_norm_
    state = str(tmp_path / "partial" / "run.pt")
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dies_on_call(clip, 8))  # in step 8: saved at steps 3 and 6
    with pytest.raises(KeyboardInterrupt):
        run(state)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    resumed = run(state)
    assert resumed["curve"] == reference
    assert [s["step"] for s in resumed["sittings"]] == [0, 6] and resumed["sittings"][1]["commit"] == "abc"

    # saved every step by time (RESUME_SECONDS 0): resumed from the step it died in
    monkeypatch.setattr(te, "RESUME_SECONDS", 0.0)
    os.remove(state)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dies_on_call(clip, 8))
    with pytest.raises(KeyboardInterrupt):
        run(state)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    assert te.unfinished_runs(str(tmp_path)) == ["run at step 7 of 12"]
    other = dataclasses.replace(c, lr=1e-3)
    with pytest.raises(SystemExit, match=r"run\.pt was saved by another run \(config differ\); delete it"):
        run(state, other)
    resumed = run(state)
    assert resumed["curve"] == reference and [s["step"] for s in resumed["sittings"]] == [0, 7]


def test_the_classic_computes_in_its_dtype_and_resumes_only_in_it(tmp_path, monkeypatch):
    """fp32 is the model's loss in float64 to rounding; bf16 autocast is measurably not (so the switch
    reaches every matmul). A state saved in one dtype is refused by a run in the other, and a state saved
    before the dtype was recorded counts as bf16 (every classic run before then computed in it)."""
    c = te.ClassicConfig(vocab_size=512, seq_len=32, num_layers=2, model_dim=32, num_heads=2, mlp_hidden=64)
    torch.manual_seed(0)
    model = te.ClassicGPT(c)
    with torch.no_grad():
        model.wte.weight.mul_(10)  # logits of order 1, where bf16's 8 mantissa bits show in the loss
    val = np.random.default_rng(0).integers(0, 512, 97)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():  # float64 matmuls and cross-entropy
        ref = sum(F.cross_entropy(reference(torch.from_numpy(val[s:s + 32])[None])[0], torch.from_numpy(val[s + 1:s + 33])).item()
                  for s in (0, 32, 64)) / 3
    fp32 = te.classic_eval(model, val, 96, torch.device("cpu"), "fp32")
    bf16 = te.classic_eval(model, val, 96, torch.device("cpu"), "bf16")
    assert abs(fp32 - ref) < 1e-5 and abs(bf16 - ref) > 1e-4, (fp32, bf16, ref)

    train, val_path = classic_shards(tmp_path)
    c = dataclasses.replace(c, lr=1e-2, batch_tokens=64)
    run = lambda state, dtype: te.run_classic(c, train, val_path, 64 * 12, 4, 128, torch.device("cpu"), 3,  # noqa: E731
                                              state, None, dtype)
    state = str(tmp_path / "partial" / "run.pt")
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", dies_on_call(clip, 5))  # saved at step 3
    with pytest.raises(KeyboardInterrupt):
        run(state, "fp32")
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    with pytest.raises(SystemExit, match=r"run\.pt was saved by another run \(dtype differ\); delete it"):
        run(state, "bf16")
    saved = torch.load(state, weights_only=False)
    assert saved["identity"].pop("dtype") == "fp32"
    torch.save(saved, state)  # as a state saved before the dtype was recorded: bf16
    with pytest.raises(SystemExit, match=r"\(dtype differ\)"):
        run(state, "fp32")
    assert [s["step"] for s in run(state, "bf16")["sittings"]] == [0, 3]


def test_the_classic_dtype_follows_the_flag_then_the_folder_then_the_state(tmp_path, monkeypatch):
    """--cpu_dtype auto takes the dtype of the classic runs already in the results folder (runs saved
    before it was recorded: bf16), else the resumed state's, else the timed choice; a forced dtype that
    differs from the folder's, or a folder of two dtypes under auto, stops with one line; GPUs: bf16.
    A folder's or state's dtype this CPU runs over 4x slower than the other is warned of at the start."""
    c, cpu, folder = te.ClassicConfig(model_dim=32, mlp_hidden=64), torch.device("cpu"), str(tmp_path / "r")
    rates = {torch.bfloat16: 50.0, torch.float32: 100.0}  # an AVX512-BF16 CPU without AMX: bf16 half as fast
    monkeypatch.setattr(te.T, "matmul_gflops", lambda dtype, m, k, n: rates[dtype])
    assert te.classic_dtype("auto", c, torch.device("cuda"), folder)[0] == "bf16"
    assert te.classic_dtype("fp32", c, cpu, folder) == ("fp32", "classic dtype fp32 (--cpu_dtype)")
    timed, note = te.classic_dtype("auto", c, cpu, folder)
    assert (timed, note.split(" on ")[0]) == ("fp32", "classic dtype fp32 (auto: 256x32x64 matmul GFLOP/s per process: "
                                                  f"bf16 50.0, fp32 100.0; capability {torch.backends.cpu.get_cpu_capability()})")
    state = str(tmp_path / "partial" / "run.pt")
    os.makedirs(os.path.dirname(state))
    torch.save({"identity": {"dtype": "fp32"}}, state)
    assert te.classic_dtype("auto", c, cpu, folder, state)[0] == "fp32"
    torch.save({"identity": {}}, state)  # saved before the dtype was recorded
    assert te.classic_dtype("auto", c, cpu, folder, state) == ("bf16", f"classic dtype bf16 (auto: that of the state it resumes, {state})")
    rates[torch.bfloat16] = 1.4  # AVX2 only: bf16 ~90x slower
    assert te.classic_dtype("auto", c, cpu, folder, state)[1] == (
        f"classic dtype bf16 (auto: that of the state it resumes, {state}); WARNING: this CPU runs bf16 71x slower than "
        "fp32 (256x32x64 matmul GFLOP/s per process: bf16 1.4, fp32 100.0): the run takes about that many times "
        "longer; in a new --save folder auto takes fp32")
    rates[torch.bfloat16] = 50.0

    os.makedirs(folder)
    with open(os.path.join(folder, "classic_lr0.001_b1024_ctx128_s0.json"), "w") as f:
        json.dump({"curve": [[0, 10.0]], "tokens": 1}, f)  # no classic_dtype: bf16
    assert te.classic_dtype("auto", c, cpu, folder, state) == ("bf16", f"classic dtype bf16 (auto: that of the classic runs saved in {folder})")
    rates[torch.bfloat16] = 1.4
    assert te.classic_dtype("auto", c, cpu, folder, state)[1].startswith(
        f"classic dtype bf16 (auto: that of the classic runs saved in {folder}); WARNING: this CPU runs bf16 71x slower")
    rates[torch.bfloat16] = 50.0
    with pytest.raises(SystemExit, match=r"holds classic runs computed in bf16, not --cpu_dtype fp32; pass --cpu_dtype bf16"):
        te.classic_dtype("fp32", c, cpu, folder)
    with open(os.path.join(folder, "classic_lr0.002_b1024_ctx128_s0.json"), "w") as f:
        json.dump({"curve": [[0, 10.0]], "tokens": 1, "classic_dtype": "fp32"}, f)
    with pytest.raises(SystemExit, match=r"holds classic runs computed in bf16 and fp32; pass --cpu_dtype"):
        te.classic_dtype("auto", c, cpu, folder)


def test_the_recipe_dtype_is_settled_once_per_folder(tmp_path, monkeypatch, capsys):
    """The recipe's --cpu_dtype auto is timed for a folder's first recipe run only: later runs (seeds,
    search points, ablations) take the saved runs' dtype however their own timing would come out, as on
    a native-bf16 CPU where bf16 and fp32 time close. Here the first timing favours fp32 and every later
    one bf16: both seeds compute in fp32. A run resuming a checkpoint keeps the flag it was started under
    (train_gpt refuses another); a forced other dtype is refused in one line before any training."""
    folder = str(tmp_path / "r")
    timings = []

    def gflops(dtype, m, k, n):  # two calls per timing (one per dtype)
        timings.append(dtype)
        first = len(timings) <= 2
        return {torch.float32: 100.0 if first else 50.0, torch.bfloat16: 50.0 if first else 100.0}[dtype]

    monkeypatch.setattr(te.T, "matmul_gflops", gflops)
    te.main(["--smoke", "--run", "recipe", "--seeds", "0,1", "--save", folder, "--no_plot"])
    out = capsys.readouterr().out
    assert [read_json(tmp_path / "r" / f"recipe_s{s}.json")["recipe_dtype"] for s in (0, 1)] == ["fp32", "fp32"]
    assert "recipe dtype auto (timed by train_gpt at the start" in out
    assert f"recipe dtype fp32 (auto: that of the recipe runs saved in {folder})" in out
    cpu, args = torch.device("cpu"), te.T.Hyperparameters()
    assert te.recipe_cpu_dtype("auto", args, cpu, folder) == (
        "fp32", f"recipe dtype fp32 (auto: that of the recipe runs saved in {folder})")
    assert te.recipe_cpu_dtype("auto", args, torch.device("cuda"), folder)[1] == "recipe dtype bf16 (GPU)"
    state = tmp_path / "r" / "partial" / "recipe_s2"
    (state / "recipe_s2_1" / "step_7").mkdir(parents=True)
    torch.save({"args": {"cpu_dtype": "auto"}}, state / "recipe_s2_1" / "step_7" / "model.pt")
    assert te.recipe_cpu_dtype("auto", args, cpu, folder, str(state))[0] == "auto"  # as the checkpoint was started
    with pytest.raises(SystemExit) as e:
        te.main(["--smoke", "--run", "recipe", "--seeds", "2", "--cpu_dtype", "bf16", "--save", folder])
    assert str(e.value) == (f"error: --save {folder} holds recipe runs computed in fp32, not --cpu_dtype bf16; "
                            "pass --cpu_dtype fp32 (or auto), or save into a new folder")
    assert "recipe seed 2" not in capsys.readouterr().out


def test_ctrl_c_saves_a_classic_run_after_its_step_and_a_second_stops_at_once(tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) in step 8 of a resumable classic run: the step finishes, the state is saved at step 8
    (not the last save, at step 6), the process exits with the shell's status for SIGINT (130), and the
    resumed run's curve is the uninterrupted run's to the bit. SIGTERM is caught the same way while the run
    trains, and both handlers are the caller's again afterwards. Two signals in one step stop at once."""
    train, val = classic_shards(tmp_path)
    c = te.ClassicConfig(vocab_size=512, seq_len=32, num_layers=2, model_dim=32, num_heads=2, mlp_hidden=64,
                         lr=1e-2, batch_tokens=64)
    run = lambda state="": te.run_classic(c, train, val, 64 * 12, 4, 128, torch.device("cpu"), 3, state)  # noqa: E731
    reference = run()["curve"]
    progress = [line.split(", val ")[1].split(",")[0] for line in capsys.readouterr().out.splitlines()
                if line.startswith("  step ")]  # a line at each evaluation: hours-long runs show progress
    assert progress == [f"{v:.4f}" for _, v in reference[1:]] and len(progress) == 4
    state = str(tmp_path / "partial" / "run.pt")
    clip, handlers = torch.nn.utils.clip_grad_norm_, (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    sigterm_in_step = []

    def ctrl_c():  # noting the SIGTERM handler in force in that step too
        sigterm_in_step.append(signal.getsignal(signal.SIGTERM))
        signal.raise_signal(signal.SIGINT)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", on_call(clip, 8, ctrl_c))
    with pytest.raises(SystemExit) as exit_:
        run(state)
    assert exit_.value.code == 130 and "stopped at step 8 of 12; the same command continues" in capsys.readouterr().out
    assert sigterm_in_step[0] not in (signal.SIG_DFL, handlers[1])  # kill would have been caught too
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert te.unfinished_runs(str(tmp_path)) == ["run at step 8 of 12"]
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    resumed = run(state)
    assert resumed["curve"] == reference and [s["step"] for s in resumed["sittings"]] == [0, 8]

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", on_call(clip, 3, lambda: [ctrl_c(), ctrl_c()]))
    other_state = str(tmp_path / "partial" / "other.pt")
    with pytest.raises(KeyboardInterrupt):
        run(other_state)
    assert not os.path.exists(other_state)  # nothing saved: the second signal did not wait for the step
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_classic_run_keeps_its_printed_output_in_its_log(tmp_path, monkeypatch, capsys):
    """--run search writes what a classic run prints to DIR/logs/<run>.txt as it goes, whatever the
    terminal was redirected to: each sitting under a line with its commit, threads and command. Stopped by
    Ctrl-C in step 2 of 3 and continued by the same command, the log holds both sittings, its evaluation
    lines are the saved curve's, and the JSON names the log."""
    folder = str(tmp_path / "r")
    argv = ["--smoke", "--run", "search", "--search_lr", "0.01", "--save", folder]  # 3 steps, evaluated at 3
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", on_call(clip, 2, lambda: signal.raise_signal(signal.SIGINT)))
    with pytest.raises(SystemExit) as exit_:
        te.main(argv)
    assert exit_.value.code == 130
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    te.main(argv)
    out = capsys.readouterr().out
    name = "classic_lr0.01_b1024_ctx128_s0"
    run = read_json(tmp_path / "r" / f"{name}.json")
    assert run["log"] == os.path.join("logs", f"{name}.txt")
    lines = open(os.path.join(folder, run["log"]), encoding="utf-8").read().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("# sitting ")]
    assert len(headers) == 2 and headers[0] == 0
    for i in headers:
        assert lines[i].endswith(f", commit {te.git_commit()}, {torch.get_num_threads()} threads: "
                                 + " ".join([sys.argv[0], *argv]))
    first, second = lines[1:headers[1]], lines[headers[1] + 1:]
    assert first[0] == second[0] == ("classic seed 0: 4 layers x 64, context 128, batch 1,024 tokens, AdamW lr "
                                     "0.01, 3 steps")
    assert first[-1].startswith("  stopped at step 2 of 3;") and second[2].startswith("  resuming at step 2 of 3 ")
    evaluations = [re.match(r"  step ([\d,]+) of 3: ([\d,]+) tokens, val (\d+\.\d{4}), ", line) for line in lines]
    assert [(int(m[2].replace(",", "")), m[3]) for m in evaluations if m] == \
        [(t, f"{v:.4f}") for t, v in run["curve"][1:]] and len(run["curve"]) == 2
    assert second[-1] == f"  best val {te.best_point(run['curve'])[1]:.4f} in {run['seconds']:.0f}s"
    assert all(line in out for line in second)  # the terminal got the same lines
    assert not any("floor, " in line for line in lines)  # the invocation's report is not the run's


def test_an_interrupted_recipe_run_resumes_from_its_newest_checkpoint(tmp_path, monkeypatch, capsys):
    """A recipe run stopped by SIGTERM saves after the step in flight and exits (143); killed mid-step,
    it keeps its last checkpoint. Either way the next invocation continues from the newest checkpoint in
    DIR/partial/ (its shards copied there: the next invocation's scratch folder has another name), with
    a log of its own, and saves the curve of the run that was never stopped; the state is then gone."""
    flags = ["--preset", "test", "--run", "recipe", "--tokens", "12000", "--evals", "4", "--val_tokens", "1024",
             "--cpu_dtype", "fp32"]  # not timed at start-up: the two runs must compute alike
    te.main([*flags, "--save", str(tmp_path / "whole")])
    forward_backward, handler = tg.forward_backward, signal.getsignal(signal.SIGTERM)
    folder = tmp_path / "resumed"
    monkeypatch.setattr(tg, "forward_backward", on_call(forward_backward, 5, lambda: signal.raise_signal(signal.SIGTERM)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # in step 5 of 11
        te.main([*flags, "--save", str(folder)])
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) == handler
    assert "  stopped at step 5 of 11; the same command continues from " in capsys.readouterr().out
    monkeypatch.setattr(tg, "forward_backward", dies_on_call(forward_backward, 4))  # in step 9: its 4th of this sitting
    with pytest.raises(KeyboardInterrupt):
        te.main([*flags, "--save", str(folder)])
    assert te.newest_checkpoint(str(folder / "partial" / "recipe_s0"))[0] == 8  # 9+2 steps: one checkpoint a step
    kept = glob.glob(str(folder / "partial" / "recipe_s0" / "*" / "step_*"))
    # the one the second sitting resumed from, and that sitting's newest 2 (the first sitting's step 4 is gone)
    assert sorted(map(os.path.basename, kept)) == ["step_000005", "step_000007", "step_000008"]
    monkeypatch.setattr(tg, "forward_backward", forward_backward)
    capsys.readouterr()
    te.main(["--load", str(folder)])
    assert "stopped midway, continued by the same command: recipe_s0 at step 8" in capsys.readouterr().out
    te.main([*flags, "--save", str(folder)])
    assert "resuming at step 8 of 11" in capsys.readouterr().out
    whole, resumed = (read_json(tmp_path / f / "recipe_s0.json") for f in ("whole", "resumed"))
    assert len(whole["curve"]) == 7 and resumed["curve"] == whole["curve"]  # steps 0, 2, ..., 10 and 11
    assert [s["step"] for s in resumed["sittings"]] == [0, 5, 8] and "sittings" not in whole
    assert [s["log"][-10:] for s in resumed["sittings"][1:]] == ["_part2.txt", "_part3.txt"]
    assert [s["threads"] for s in resumed["sittings"]] == [torch.get_num_threads()] * 3
    assert resumed["log"] == resumed["sittings"][0]["log"]
    assert all(os.path.isfile(folder / s["log"]) for s in resumed["sittings"])
    assert sorted(os.listdir(folder)) == ["curves.png", "logs", "recipe_s0.json"]  # partial/ gone with the state


def test_flops_formula_counts_spec_shapes():
    with torch.device("meta"):
        model = tg.GPT(tg.Hyperparameters(), world_size=8)
    assert step_timing.matrix_params(model) == 75_497_472                   # records/README.md: block matrices
    assert model.args.model_dim * model.args.padded_vocab_size == 38_633_472  # records/README.md: LM head


def test_step_budget_counts_by_hand():
    """The budget's per-token FLOPs and per-rank state bytes against the shapes written out."""
    args = tg.Hyperparameters()
    with torch.device("meta"):
        model = tg.GPT(args, world_size=8)
    f = step_budget.flops_per_token(args, model, 0)  # stage 1: windows 128 / 384 tokens
    D, V = 768, 50304
    assert f["Q/K/V/O projections"] == 6 * 4 * D * D * 10 and f["MLP"] == 6 * 2 * D * 3072 * 11
    assert f["LM head"] == 6 * D * V and f["DC"] == 12 * D * 112
    assert f["attention scores and values"] == 12 * D * (8 * 129 + 2 * 385)  # 8 short rows, 2 long
    assert f["MUDD gates and layers"] == 6 * 64 * (4 * D + 26 + 41 + 14 + 5)
    pe = lambda s, L: 5 * (4 * s * s * L + 2 * s ** 3)  # noqa: E731  Polar Express, short side s
    assert step_budget.optimizer_flops(model) == 64 * pe(256, 768) + 24 * pe(768, 768) + 24 * pe(768, 3072)
    b = step_budget.state_bytes(model, 8)
    fp32 = 24 + 2 * 22 + 1  # scalars, resid/post lambdas, the MUDD gate scale
    assert b["parameters"] == b["gradients"] == 2 * (643_751_335 - fp32) + 4 * fp32
    sharded = 2 * 38_633_472 + 193_167_360 + 289_751_040  # lm_head, embed, value_embeds, bigram_embed
    assert b["Adam state"] == pytest.approx(8 * (sharded / 8 + (643_751_335 - sharded - 75_497_472
                                                                 - (4 * 256 + 4 * 768 + 2 * 3072) * 768)))


def test_mean_keys_matches_the_attention_mask():
    inputs, _, cu, _ = batch()
    doc = tg.document_ids(cu, inputs.numel())
    for window in (1, 16, 64, 1000):
        for pos_div in (1, 2):
            dense = tg.dense_attention_mask(doc, window, pos_div)
            assert step_timing.mean_keys(cu, inputs.numel(), window, pos_div) == pytest.approx(
                float(dense.sum()) / (inputs.numel() * pos_div))
    model = tg.GPT(TEST)
    model.set_windows(1, 3)
    b = tg.Batch(inputs, None, cu, None)
    per_head = 12 * TEST.head_dim * TEST.num_heads
    expected = 0.0
    for i, row in zip(model.attn_layers, ("paired short", "attn long", "attn long dc")):
        r = 2 if "paired" in row else 1
        # paired: 2T query slots with H/2 heads each
        keys = float(tg.dense_attention_mask(doc, int(model.windows[1 if "long" in row else 0]), r).sum()) / r
        if "dc" in row:
            keys += float(tg.dense_attention_mask(doc, TEST.dc_window - 1).sum())
        expected += per_head * keys / inputs.numel()
    assert step_timing.attention_flops_per_token(model, [b]) == pytest.approx(expected)


# ---- the scripts themselves ------------------------------------------------------------------------

def run_script(*argv, timeout=300):
    out = warm_python.run(argv, cwd=REPO, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_main(main, *argv) -> str:
    """A script's main(argv) in this process, its printed output: what run_script runs, without a process
    (the script's own imports, a second or more). The smoke tests keep a run_script each for the script's
    entry point."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(list(argv)) in (None, 0)
    return buf.getvalue()


@pytest.mark.slow
def test_recipe_learning_rate_search_smoke(tmp_path):
    """--run recipe_search on a tuning split trains the grid on seed 0; --recipe_from then trains the
    compared recipe at the winner's rates (the lowest best val loss of the grid)."""
    tune, folder = str(tmp_path / "tune"), str(tmp_path / "r")
    script = "tests/benchmarks/token_efficiency.py"
    run_main(te.main, "--smoke", "--val_set", "tune", "--run", "recipe_search", "--search_muon_lr", "0.001,0.03",
             "--search_adam_lr", "0.0001,0.01", "--save", tune)
    runs = te.read_runs(tune, te.RECIPE_SEARCH_PREFIX)
    assert sorted(runs) == ["rsearch_m0.001_a0.0001_s0", "rsearch_m0.001_a0.01_s0", "rsearch_m0.03_a0.0001_s0",
                            "rsearch_m0.03_a0.01_s0"]
    assert {r["val_set"] for r in runs.values()} == {"tune"}
    best = min(runs.values(), key=lambda r: min(v for _, v in r["curve"]))
    out = run_script(script, "--smoke", "--run", "recipe", "--recipe_from", tune, "--save", folder)
    assert f"NorMuon lr {best['recipe_muon_lr']:g}, Adam lr {best['recipe_adam_lr']:g}" in out
    recipe = read_json(os.path.join(folder, "recipe_s0.json"))
    assert (recipe["recipe_muon_lr"], recipe["recipe_adam_lr"]) == (best["recipe_muon_lr"], best["recipe_adam_lr"])
    assert recipe["val_set"] == "even" and recipe["val_digest"] != runs["rsearch_m0.03_a0.01_s0"]["val_digest"]
    table = te.recipe_search_table(runs).splitlines()
    marked = [line.split()[:2] for line in table if line.endswith("<- best")]
    assert marked == [[f"{best['recipe_muon_lr']:g}", f"{best['recipe_adam_lr']:g}"]]
    assert sum("is the smallest value searched" in line or "is the largest value searched" in line
               for line in table) == 2  # a 2 x 2 grid: every winner is on both edges


def test_token_efficiency_smoke(tmp_path):
    """A 2-point classic search, the recipe on two seeds and the search winner on a second seed, each a
    separate invocation on one results folder (as on a 2-core machine; the recipe's a process), then --load
    joins them."""
    folder = str(tmp_path / "r")
    script = "tests/benchmarks/token_efficiency.py"
    out = run_main(te.main, "--smoke", "--run", "search", "--search_lr", "0.001,0.01", "--save", folder)
    assert "one side only (classic runs: a tuning folder): no comparison, no ratio" in out
    assert "classic configurations (seed 0; more than one: the search): 2" in out  # a one-sided folder's table
    run_script(script, "--smoke", "--run", "recipe", "--seeds", "0,1", "--save", folder)
    out = run_main(te.main, "--smoke", "--run", "classic", "--seeds", "0,1", "--save", folder)
    assert "classic: the search winner saved in" in out and "classic_lr0.01_b1024_ctx128_s0: saved" in out
    saved = sorted(f.name for f in (tmp_path / "r").iterdir())
    assert saved == ["classic_lr0.001_b1024_ctx128_s0.json", "classic_lr0.01_b1024_ctx128_s0.json",
                     "classic_lr0.01_b1024_ctx128_s1.json", "curves.png", "logs", "recipe_s0.json", "recipe_s1.json"]
    runs = {f.name: read_json(f) for f in (tmp_path / "r").glob("*.json")}
    recipe = runs["recipe_s1.json"]
    assert os.path.isfile(os.path.join(folder, recipe["log"])) and recipe["log"].startswith("logs" + os.sep)
    assert recipe["command"][1:] == ["--smoke", "--run", "recipe", "--seeds", "0,1", "--save", folder]
    assert recipe["commit"] == te.git_commit()
    log = open(os.path.join(folder, recipe["log"]), encoding="utf-8").read()  # the dtype train_gpt chose and logged
    assert recipe["recipe_dtype"] in te.CLASSIC_DTYPES and f"\ncpu dtype {recipe['recipe_dtype']} (" in log
    # both sides of a seed on the same validation tokens and the same training order, with the same floor
    classic = runs["classic_lr0.01_b1024_ctx128_s1.json"]
    for key in ("val_set", "val_tokens", "val_digest", "train_order", "floor"):
        assert recipe[key] == classic[key], key
    assert recipe["val_set"] == "even" and recipe["train_order"] == "shuffled"
    assert recipe["floor"] != runs["recipe_s0.json"]["floor"]  # each seed trains on its own order
    out = run_main(te.main, "--load", folder)
    best = {line.split()[0]: float(line.split()[4]) for line in out.splitlines() if line.startswith(("   0.001", "    0.01"))}
    assert best["0.01"] < best["0.001"] < 10.9        # a few steps from ln(50304) = 10.83; the higher lr wins
    assert "0.01   1,024     128      3" in out and "<- best" in out.split("0.01   1,024")[1].splitlines()[0]
    assert "tuned classic (the search winner): lr 0.01, batch 1,024, context 128" in out
    dtypes = {r["classic_dtype"] for n, r in runs.items() if n.startswith("classic_")}  # the first run's, then the folder's
    assert len(dtypes) == 1 and f"classic compute dtype: {dtypes.pop()}\n" in out
    assert runs["recipe_s0.json"]["recipe_dtype"] == recipe["recipe_dtype"]  # the first seed's, then the folder's
    assert f"recipe compute dtype: {recipe['recipe_dtype']}\n" in out
    assert "recipe best val: mean" in out and "(2 seeds)" in out
    floor = [line for line in out.splitlines() if line.startswith("floor, ")][0]
    mean_bigram = (runs["recipe_s0.json"]["floor"]["bigram"] + recipe["floor"]["bigram"]) / 2
    assert f"interpolated bigram {mean_bigram:.4f}" in floor and "recorded by the runs" in floor
    # a few steps from ln(50304): far above the bigram floor, so no ratio
    assert "ratio: not stated: the classic's best val loss" in out and "ratio: mean" not in out


def test_token_efficiency_tables_by_hand(tmp_path):
    """The search winner, the per-seed ratios and their spread, the floor that allows or refuses them,
    and the ablation deltas and p-values on saved curves whose answers are computed here by hand."""
    floor = {"unigram": 9.0, "bigram": 8.0, "bigram_weight": 0.5, "train_tokens": 400}
    meta = {"tokens": 400, "val_tokens": 64, "preset": "test", "val": "v", "classic_params": {"total": 1, "non-embedding": 1},
            "floor": floor}
    classic = lambda lr, seed, best: te.save_curve(str(tmp_path), te.classic_name(  # noqa: E731
        te.ClassicConfig(lr=lr, batch_tokens=100, seq_len=50), seed), [(0, 10.0), (200, best), (400, best + 0.5)],
        {**meta, "seed": seed, "classic_lr": lr, "classic_batch_tokens": 100, "classic_seq_len": 50})
    classic(0.001, 0, 6.0)
    classic(0.002, 0, 5.0)   # the winner: best 5.0 at 200 tokens
    classic(0.002, 1, 5.5)   # best 5.5 at 200 tokens
    for seed, mid in ((0, 6.0), (1, 7.0)):   # recipe: 10 -> mid at 100 -> 4.0 at 200
        te.save_curve(str(tmp_path), f"recipe_s{seed}", [(0, 10.0), (100, mid), (200, 4.0)], {**meta, "seed": seed})
    runs = te.load_runs(str(tmp_path), None)
    assert te.search_winner(runs)["classic_lr"] == 0.002
    floors = te.folder_floors(str(tmp_path), runs)
    table, ratios = te.seeds_table(runs, floors)
    # seed 0: 5.0 is reached at 100 + 100 * (6 - 5) / (6 - 4) = 150; seed 1: 5.5 at 100 + 100 * 1.5 / 3 = 150
    assert ratios == pytest.approx([150 / 200, 150 / 200])
    assert "ratio: mean 0.7500, std 0.0000" in table and "not stated" not in table
    # the tuned classic's best, (5.0 + 5.5) / 2 = 5.25, must be 0.3 below the bigram floor: 5.55 allows, 5.56 does not
    for bigram, stated in ((5.56, True), (5.54, False)):
        table, ratios = te.seeds_table(runs, te.Floors({s: {**floor, "bigram": bigram} for s in (0, 1)}, "here"))
        assert (ratios != []) == stated and ("ratio: mean" in table) == stated
        assert ("ratio: not stated: the classic's best val loss 5.2500 is not 0.3 below the interpolated "
                f"bigram's {bigram:.4f}" in table) != stated
    table, ratios = te.seeds_table(runs, te.Floors({}, "not known: no shards"))
    assert ratios == [] and "ratio: not stated: no bigram floor for these runs (not known: no shards)" in table
    at = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.startswith(" " * 42)}
    assert at["100"] == ["6.5000", "7.6250"] and at["400"] == ["4.0000", "5.7500"]  # recipe flat after 200
    # a row with one seed (a long run's first): its spread and p-values are not defined and show as "-";
    # while no row has two pairs the footer says there is no Holm p yet
    def cells(lines: list[str], name: str) -> list[str]:  # a row's columns after its name
        return [line for line in lines if line.startswith(name)][0][len(name):].split()

    z_name = te.ABLATIONS[9][0]
    te.save_curve(str(tmp_path), "ablate_z_s0", [(400, 4.3)], {**meta, "seed": 0, "component": z_name})
    runs = te.load_runs(str(tmp_path), None)
    lines = te.ablation_table(runs, te.folder_floors(str(tmp_path), runs)).splitlines()
    assert cells(lines, z_name) == ["1", "4.3000", "+-", "-", "+0.3000", "-", "1", "+0.3000", "-", "-", "-", "0:+0.3000"]
    assert "Holm p: none yet" in lines[-1] and "nan" not in "\n".join(lines)
    for seed, final in ((0, 4.5), (1, 4.7), (2, 4.6)):
        te.save_curve(str(tmp_path), f"ablate_x_s{seed}", [(400, final)], {**meta, "seed": seed, "component": te.ABLATIONS[5][0]})
    for seed, final in ((0, 4.1), (1, 4.4)):
        te.save_curve(str(tmp_path), f"ablate_y_s{seed}", [(400, final)], {**meta, "seed": seed, "component": te.ABLATIONS[7][0]})
    runs = te.load_runs(str(tmp_path), None)
    lines = te.ablation_table(runs, te.folder_floors(str(tmp_path), runs)).splitlines()
    assert "interpolated bigram 8.0000" in lines[1]
    # columns: n, mean, +-, sd, delta, Welch p, pairs, paired delta, paired p, Holm p, Holm < 0.05, per-seed deltas
    x, y = cells(lines, te.ABLATIONS[5][0]), cells(lines, te.ABLATIONS[7][0])
    # Welch: the full recipe's two 4.0s add no variance, so t = 0.6 / sqrt(0.01 / 3) with n - 1 = 2 dof,
    # where Student's two-sided p = 1 - |t| / sqrt(2 + t^2)
    t = 0.6 / math.sqrt(0.01 / 3)
    assert float(x[4]) == pytest.approx(0.6, abs=1e-4) and float(x[5]) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-4)
    assert x[11:] == ["0:+0.5000", "1:+0.7000"]  # seed 2 has no full-recipe run to pair with
    # paired: x's deltas 0.5, 0.7 (mean 0.6, sd 0.1414, t = 6, 1 dof); y's 0.1, 0.4 (mean 0.25, t = 1.6667);
    # with 1 degree of freedom p = 1 - 2 atan(|t|) / pi; Holm: the smaller p times 2, the larger times 1
    px, py = 1 - 2 * math.atan(6.0) / math.pi, 1 - 2 * math.atan(0.25 / (0.3 / math.sqrt(2) / math.sqrt(2))) / math.pi
    assert x[6] == "2" and float(x[7]) == pytest.approx(0.6, abs=1e-4) and float(x[8]) == pytest.approx(px, abs=1e-4)
    assert float(y[7]) == pytest.approx(0.25, abs=1e-4) and float(y[8]) == pytest.approx(py, abs=1e-4)
    assert float(x[9]) == pytest.approx(2 * px, abs=1e-4) and float(y[9]) == pytest.approx(max(2 * px, py), abs=1e-4)
    assert x[10] == y[10] == "no"
    assert "adjusted over the 2 rows" in lines[-1]  # the one-seed row z has no p: not one of the tests
    assert cells(lines, z_name)[9] == "-"


def test_loader_coverage_by_hand(tmp_path):
    """Documents of 10, 30, 5 and 20 tokens (BOS included), 16 + 1 tokens per step in one micro-batch,
    documents truncated to 8. Step 1 takes 8 of doc 0, 8 of doc 1, 1 of doc 2 (17 seen); step 2 takes 8
    of doc 3, then wraps: 8 of doc 0, 1 of doc 1 (25 seen); step 3 takes all 5 of doc 2, 8 of doc 3 and 4
    of doc 0 (29 seen). 65 tokens in all; 3 documents walked per step."""
    docs = [[tg.BOS_ID] + [7] * (n - 1) for n in (10, 30, 5, 20)]
    tg.write_shard(str(tmp_path / "x_train_000001.bin"), np.array(sum(docs, []), dtype=np.uint16))
    args = dataclasses.replace(TEST, train_files=str(tmp_path / "x_train_*.bin"), micro_batches=1, num_iterations=3,
                               extension_iterations=0,
                               stages=tg.restaged(TEST.stages, batch_tokens=(16,) * 4, max_doc_len=(8,) * 4))
    cov = stage_rise.coverage_by_step(args, 3)
    assert [w for w, _ in cov] == pytest.approx([3 / 4, 6 / 4, 9 / 4])
    assert [f for _, f in cov] == pytest.approx([17 / 65, 25 / 65, 29 / 65])


def test_token_efficiency_load_errors_are_one_line(tmp_path):
    """Bad folders and flags stop with one "error: ..." line: as a process's whole stderr (two cases,
    each a process), the rest as the SystemExit message in this process."""
    script = os.path.join(REPO, "tests", "benchmarks", "token_efficiency.py")

    def err(*argv):
        out = warm_python.run([script, *argv], cwd=REPO, timeout=300)
        assert out.returncode != 0 and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
        return out.stderr

    def err_here(*argv):
        with pytest.raises(SystemExit) as e:
            te.main(list(argv))
        assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
        return str(e.value)

    assert "no such folder" in err("--load", str(tmp_path / "nowhere"))
    assert "needs recipe_s*.json or classic_*.json" in err_here("--load", str(tmp_path))
    te.save_curve(str(tmp_path), "recipe_s0", [(0, 10.8), (100, 9.0)], {"tokens": 100})
    te.save_curve(str(tmp_path), "classic_lr0.001_b10_ctx10_s0", [(0, 10.8), (100, 9.0)], {"tokens": 200})
    assert "different --tokens budgets" in err_here("--load", str(tmp_path))
    te.save_curve(str(tmp_path), "classic_lr0.001_b10_ctx10_s0", [(0, 10.8), (100, 9.0)], {"tokens": 100})
    assert "--tokens 100" in err_here("--load", str(tmp_path), "--tokens", "200")
    (tmp_path / "recipe_s0.json").write_text("{not json")
    assert "not a saved curve" in err("--load", str(tmp_path))
    assert "--seeds" in err_here("--seeds", "a,b", "--smoke")
    assert "no classic search runs" in err_here("--smoke", "--run", "classic", "--classic_from", str(tmp_path / "r2"))
    (tmp_path / "r2").mkdir()
    assert "no classic search runs" in err_here("--smoke", "--run", "classic", "--classic_from", str(tmp_path / "r2"))

    assert "--val_tokens 0 must be >= 1" in err_here("--smoke", "--val_tokens", "0")
    assert "--val_tokens 700 must be a multiple" in err_here("--smoke", "--val_tokens", "700")
    old = tmp_path / "old"  # a run saved before the validation set and order were recorded
    te.save_curve(str(old), "recipe_s0", [(0, 10.8)], {"tokens": 3072, "val_tokens": 1024, "preset": "test",
                                                       "train": "data/tinyshakespeare/tinyshakespeare_train_*.bin",
                                                       "val": "data/tinyshakespeare/tinyshakespeare_val_*.bin"})
    message = err_here("--smoke", "--run", "recipe", "--save", str(old))
    assert f"--save {old} holds runs on other data" in message and "--val_set first --train_order file" in message
    te.save_curve(str(old), "classic_lr0.001_b10_ctx10_s0", [(0, 10.8)], {"tokens": 3072, "val_set": "even", "val_tokens": 1024})
    assert "runs on different data" in err_here("--load", str(old))


def test_compare_two_runs_by_hand(tmp_path, capsys):
    """--load DIR --compare A,B against curves whose differences are set by hand: A - B at each
    evaluation, where A leads, trails and is level, the best and last losses, the floor gaps and how far
    each best is from the 0.3 below the bigram that a ratio needs (A short of it, B clear)."""
    floor = {"unigram": 6.0, "bigram": 3.75, "bigram_weight": 0.9, "train_tokens": 400}
    a = [(0, 10.0), (100, 5.0), (200, 4.0), (300, 3.75), (400, 3.5), (410, 3.625)]
    b = [(0, 10.0), (101, 5.5), (200, 3.875), (300, 3.75001), (400, 3.25), (410, 3.125)]  # 300: level to 4 places
    for lr, curve in ((0.001, a), (0.002, b)):
        te.save_curve(str(tmp_path), f"classic_lr{lr}_b10_ctx10_s0", curve, {
            "tokens": 410, "seed": 0, "floor": floor, "classic_lr": lr, "classic_batch_tokens": 10, "classic_seq_len": 10})
    te.main(["--load", str(tmp_path), "--compare", "classic_lr0.001_b10_ctx10_s0,classic_lr0.002_b10_ctx10_s0.json"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["A classic_lr0.001_b10_ctx10_s0: lr 0.001, batch 10, context 10, seed 0",
                         "B classic_lr0.002_b10_ctx10_s0: lr 0.002, batch 10, context 10, seed 0"]
    assert [line.split() for line in lines[4:10]] == [
        ["0", "0", "10.0000", "0", "10.0000", "+0.0000"], ["1", "100", "5.0000", "101", "5.5000", "-0.5000"],
        ["2", "200", "4.0000", "200", "3.8750", "+0.1250"], ["3", "300", "3.7500", "300", "3.7500", "+0.0000"],
        ["4", "400", "3.5000", "400", "3.2500", "+0.2500"], ["5", "410", "3.6250", "410", "3.1250", "+0.5000"]]
    assert lines[10:] == [
        "A leads at 1 of the 5 evaluations after step 0, by 0.5000 to 0.5000; trails at 3, by 0.1250 to 0.5000; level at 1",
        "best: A 3.5000 at 400 tokens, B 3.1250 at 410 tokens: A 0.3750 behind",
        "last: A 3.6250, B 3.1250: A 0.5000 behind",
        "A's best is 0.2500 below the interpolated bigram of seed 0 (3.7500); a ratio needs 3.4500: 0.0500 short",
        "B's best is 0.6250 below the interpolated bigram of seed 0 (3.7500); a ratio needs 3.4500: cleared by 0.3250"]


def test_compare_refuses_runs_it_cannot_pair(tmp_path, capsys):
    """Runs evaluated a different number of times or at token counts over 2% apart, a name the folder
    lacks, one name, and --compare without --load: each one "error: ..." line. Runs 2% apart are paired,
    and so are runs whose one evaluation is the final one (not step 0)."""
    def err(*argv):
        with pytest.raises(SystemExit) as e:
            te.main(list(argv))
        assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
        return str(e.value)

    te.save_curve(str(tmp_path), "classic_a_s0", [(0, 10.0), (100, 5.0), (200, 4.0)], {"tokens": 200})
    te.save_curve(str(tmp_path), "classic_b_s0", [(0, 10.0), (200, 4.0)], {"tokens": 200})
    te.save_curve(str(tmp_path), "classic_c_s0", [(0, 10.0), (103, 5.0), (200, 4.0)], {"tokens": 200})
    te.save_curve(str(tmp_path), "classic_d_s0", [(0, 10.0), (102, 5.0), (200, 4.0)], {"tokens": 200})
    d = str(tmp_path)
    assert "classic_a_s0 has 2 evaluations after step 0 and classic_b_s0 1" in err("--load", d, "--compare", "classic_a_s0,classic_b_s0")
    assert "evaluation 1 is at 100 tokens in classic_a_s0 and 103" in err("--load", d, "--compare", "classic_a_s0,classic_c_s0")
    te.main(["--load", d, "--compare", "classic_a_s0,classic_d_s0"])  # 2% apart: paired
    te.save_curve(d, "classic_f_s0", [(200, 4.5)], {"tokens": 200})  # --evals 0: the final evaluation alone
    te.save_curve(d, "classic_g_s0", [(200, 4.0)], {"tokens": 200})
    capsys.readouterr()
    te.main(["--load", d, "--compare", "classic_f_s0,classic_g_s0"])
    assert "A leads at 0 of the 1 evaluations after step 0; trails at 1, by 0.5000 to 0.5000; level at 0" in \
        capsys.readouterr().out
    assert "holds no run classic_e_s0" in err("--load", d, "--compare", "classic_a_s0,classic_e_s0")
    assert "give two different runs" in err("--load", d, "--compare", "classic_a_s0")
    assert "give two different runs" in err("--load", d, "--compare", "classic_a_s0,classic_a_s0")
    assert "--compare A,B needs --load DIR" in err("--compare", "classic_a_s0,classic_d_s0")


def test_model_dim_widens_both_sides_and_widths_do_not_mix(tmp_path, capsys):
    """--model_dim 128 on the test preset (64 wide, heads of 32): 4 heads and a 512-wide MLP for the
    recipe, the classic built at that width (its parameters counted here by hand), recorded in every
    run; a folder of another width refuses new runs in one line."""
    args = te.recipe_args("test", "", "", 3072, 0, 1024, torch.device("cpu"), model_dim=128)
    assert (args.model_dim, args.num_heads, args.head_dim, args.mlp_hidden) == (128, 4, 32, 512)
    assert te.recipe_args("test", "", "", 3072, 0, 1024, torch.device("cpu")).model_dim == 64
    folder = str(tmp_path / "wide")
    te.main(["--smoke", "--run", "search", "--search_lr", "0.01", "--model_dim", "128", "--save", folder])
    run = read_json(tmp_path / "wide" / "classic_lr0.01_b1024_ctx128_s0.json")
    d, layers = 128, args.num_layers
    per_layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    assert run["classic_params"]["non-embedding"] == layers * per_layer + 2 * d  # + the final LayerNorm
    assert run["model_dim"] == 128 and "classic seed 0: 4 layers x 128" in capsys.readouterr().out
    te.report(folder, None, plot=False)
    assert f"commit: {run['commit']} (1 run)\n" in capsys.readouterr().out
    for argv, message in ((["--model_dim", "96"], "--model_dim 96 must be an even multiple of the --preset test "
                                                  "head size (32)"),
                          (["--save", folder], f"--save {folder} holds runs of width 128, not --model_dim 64")):
        with pytest.raises(SystemExit) as e:
            te.main(["--smoke", "--run", "search", "--search_lr", "0.01", *argv])
        assert str(e.value).startswith("error: " + message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_ablation_smoke(tmp_path):
    # fp32 on both invocations: under auto each would time bf16 against fp32 on its own, and where the CPU
    # has native bf16 the two can pick differently when the machine is busy (the last check below failed so)
    out = run_script("tests/benchmarks/token_efficiency.py", "--smoke", "--ablate", "--only", "batch schedule",
                     "--seeds", "0,1", "--save", str(tmp_path), "--cpu_dtype", "fp32")
    table = out.split("switched off / replaced")[1].splitlines()
    row = [line for line in table if line.startswith("batch schedule")][0].split()
    final = lambda name: read_json(tmp_path / f"{name}.json")["curve"][-1][1]  # noqa: E731
    full = [final(f"recipe_s{s}") for s in (0, 1)]
    finals = [final(f"ablate_batch_schedule_s{s}") for s in (0, 1)]
    assert all(9.0 < x < 11.0 for x in full + finals)
    assert float(row[-9]) == pytest.approx(sum(finals) / 2 - sum(full) / 2, abs=2e-4)
    assert [float(d.split(":")[1]) for d in row[-2:]] == pytest.approx([x - f for x, f in zip(finals, full)], abs=2e-4)
    assert float(row[-6]) == pytest.approx(sum(finals) / 2 - sum(full) / 2, abs=2e-4)  # the mean paired delta
    saved = read_json(tmp_path / "ablate_batch_schedule_s1.json")
    assert os.path.isfile(tmp_path / saved["log"]) and saved["floor"] == read_json(tmp_path / "recipe_s1.json")["floor"]
    # --load of a folder of ablations alone (no classic) prints the same table, and no ratio
    loaded = run_main(te.main, "--load", str(tmp_path), "--no_plot")
    assert [line for line in loaded.split("switched off / replaced")[1].splitlines()
            if line.startswith("batch schedule")][0].split() == row
    assert "one side only (recipe runs and ablations): no comparison, no ratio" in loaded
    # a full recipe run that --ablate trains is the one --run recipe trains: same evaluations, same losses
    run_main(te.main, "--smoke", "--run", "recipe", "--seeds", "1", "--save", str(tmp_path / "sides"),
             "--cpu_dtype", "fp32")
    assert read_json(tmp_path / "recipe_s1.json")["curve"] == read_json(tmp_path / "sides" / "recipe_s1.json")["curve"]


@pytest.mark.slow
def test_stage_rise_smoke(tmp_path):
    """A variant trains (test preset), stops after --stop and saves its curve; no_untie's rows untie nowhere
    (its untie step is past the run), no_growth's the recipe's."""
    untie_steps = {}
    for variant in ("no_growth", "no_untie"):
        out = run_script("tests/benchmarks/stage_rise.py", "--smoke", "--variant", variant, "--save", str(tmp_path),
                         "--stop", "2", "--every", "1", "--val_tokens", "1024")
        assert f"{variant}: 3 validations up to step 2" in out
        saved = read_json(tmp_path / f"{variant}.json")
        assert [s for s, _ in saved["curve"]] == [0, 1, 2] and all(9.0 < v < 11.5 for _, v in saved["curve"])
        untie_steps[variant] = saved["untie_step"]
    assert untie_steps == {v: tg.untie_step(stage_rise.variant_args(v, 1, 1024, "test", te.SMOKE_TOKENS))
                           for v in untie_steps}
    # the benchmark's own schedule (demo preset, 231+9 steps): the recipe unties at 155, no_untie past the run
    as_is, no_untie = (stage_rise.variant_args(v, 10, 1024) for v in ("as_is", "no_untie"))
    assert tg.untie_step(as_is) == 155 and tg.untie_step(no_untie) >= tg.total_steps(no_untie) == 240


def test_profile_summary_splits_host_time_into_self_times():
    """A CPU profile of matmuls: aten::mm is called 3 times a step, its self time is at most its
    inclusive time, the self times of all host events add up to no more than the wall time, and
    aten::matmul (which only calls aten::mm) spends less in itself than aten::mm."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(2 * 3):
            x @ x
        wall = 1000 * (time.perf_counter() - t0)
    p = step_timing.profile_summary(prof, 2, wall, "cpu")
    ops = {name: (calls, ms) for name, calls, ms in p["top_ops"]}
    mine = {name: (calls, ms) for name, calls, ms in p["top_self"]}
    assert ops["aten::mm"][0] == mine["aten::mm"][0] == 3.0
    assert 0 < mine["aten::mm"][1] <= ops["aten::mm"][1]
    assert mine["aten::matmul"][1] < mine["aten::mm"][1]
    assert sum(ms for _, ms in mine.values()) <= wall / 2
    assert p["kernels_per_step"] == 0 and p["busy"] == 0


@pytest.mark.slow
def test_step_timing_smoke():
    out = run_script("tests/benchmarks/step_timing.py", "--smoke")
    stages = [line.split() for line in out.splitlines()
              if line.startswith(("stage ", "extension")) and line.split()[-5].replace(",", "").isdigit()]
    assert [s[0] for s in stages] == ["stage", "stage", "stage", "extension"]
    assert [int(s[3].replace(",", "")) for s in stages[:3]] == [row.batch_tokens for row in TEST.stages[:3]]
    assert "need a CUDA GPU" in out and "projected training time" in out
    # On a CPU the host runs every op as it launches it: the launch time is nearly the whole step.
    launches = [re.search(r"launches a step in ([\d.]+) ms of its ([\d.]+)", line) for line in out.splitlines()]
    launches = [(float(m[1]), float(m[2])) for m in launches if m]
    assert len(launches) == 4 and all(0.8 * ms < host <= ms for host, ms in launches), launches


@pytest.mark.slow
def test_step_timing_as_rank_0_of_8_projects_from_its_work_and_bytes():
    """--as_rank_of 8 on a CPU: rank 0's step of every stage (one micro-batch of each step's 8), the bytes it
    sends by collective (a NorMuon-only step: the padded banks' reduce_scatter and all_gather, each 7/8 of
    the banks' bytes), and the projection: steps x ms/step plus bytes / --bus_gbps."""
    out = run_script("tests/benchmarks/step_timing.py", "--smoke", "--as_rank_of", "8", "--bus_gbps", "0.001",
                     "--cpu_dtype", "fp32")
    assert "rank 0 of 8 in one process (collectives simulated) on cpu, 1 accumulation step(s)" in out
    ms = {m[1]: (int(m[2]), float(m[3])) for m in re.finditer(r"^(stage \d|extension) +(\d+) +[\d,]+ +([\d.]+)", out, re.M)}
    assert list(ms) == ["stage 1", "stage 2", "stage 3", "extension"]
    banks = 4 * sum(p.numel() for name, p in tg.GPT(tg.parse_args(["--preset", "test"]), 8).named_parameters()
                    if name.endswith("_bank"))  # fp32 bytes, padding for 8 ranks included
    sent = dict(re.findall(r"^(stage \d|extension): rank 0 sends ([\d.]+) MB per step \(all_gather [\d.]+ MB, "
                           r"reduce_scatter [\d.]+ MB\)$", out, re.M))
    assert sent == {stage: f"{2 * banks * 7 / 8 / 1e6:.2f}" for stage in ms}, out
    m = re.search(r"^projected 8-GPU time from rank 0's work \(7 steps, validation excluded\): ([\d.]+) s = ([\d.]+) s of "
                  r"rank 0's steps \+ ([\d.]+) s of communication, an estimate: the bytes rank 0 sends per step at 0 GB/s "
                  r"per direction per GPU \(nominal\), not overlapped with compute$", out, re.M)
    assert m, out
    assert float(m[2]) == pytest.approx(sum(n * t for n, t in ms.values()) / 1000, abs=0.06)
    assert float(m[3]) == pytest.approx(7 * 2 * banks * 7 / 8 / 1e6, abs=0.06)  # 7 steps at 1 MB/s
    # three figures each rounded to 0.1 s: their sum and the rounded total differ by up to 0.15 s
    assert float(m[1]) == pytest.approx(float(m[2]) + float(m[3]), abs=0.151)


def test_rank_projection_arithmetic_and_the_bus_table(monkeypatch):
    """steps x (ms + bytes / bandwidth) summed over stages; 450 GB/s per direction on the H100 SXM and the
    H200 (NVLink 4, nominal), nothing elsewhere unless --bus_gbps says it: then the bytes alone."""
    stages = [dict(stage="stage 1", steps=400, ms=50.0, comm_bytes={"reduce_scatter": 2e8, "all_gather": 2.5e8}),
              dict(stage="stage 2", steps=100, ms=80.0, comm_bytes={"all_to_all": 9e8})]
    p = step_timing.rank_projection(stages, 450.0)
    assert p["compute_s"] == pytest.approx(400 * 0.05 + 100 * 0.08)
    assert p["comm_s"] == pytest.approx((400 * 4.5e8 + 100 * 9e8) / 450e9)
    assert p["total_s"] == pytest.approx(28.0 + 0.6) and p["steps"] == 500
    none = step_timing.rank_projection(stages, None)
    assert none["comm_s"] is None and none["total_s"] is None and none["compute_s"] == pytest.approx(28.0)
    assert "communication not estimated" in step_timing.rank_projection_line(none, 8)
    assert step_timing.rank_projection_line(p, 8).startswith(
        "projected 8-GPU time from rank 0's work (500 steps, validation excluded): 28.6 s = 28.0 s of rank 0's steps + "
        "0.6 s of communication, an estimate")
    cuda = torch.device("cuda")
    for name, want in (("NVIDIA H100 80GB HBM3", 450.0), ("NVIDIA H200", 450.0), ("NVIDIA H100 PCIe", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert step_timing.bus_gb_per_s(cuda, None) == want, name
    assert step_timing.bus_gb_per_s(cuda, 100.0) == 100.0
    assert step_timing.bus_gb_per_s(torch.device("cpu"), None) is None


def test_bench_kernels_gives_the_loss_kernels_share_of_the_peak_bandwidth():
    """The loss kernel's GB/s beside the GPU's peak: H100 SXM 3.35 TB/s, H200 4.8 TB/s, by the names
    torch gives them; another GPU (an H100 PCIe too) gets no fraction."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import bench_kernels
    nbytes = 16_384 * 50_304 * 5  # one rank's stage-1 rows: bf16 read twice, e5m2 written
    line = bench_kernels.bandwidth_line("loss", 2.0, nbytes, "NVIDIA H100 80GB HBM3")
    assert re.search(r"2\.000 ms +2060\.5 GB/s = 62% of the 3\.35 TB/s peak$", line), line
    assert bench_kernels.bandwidth_line("loss", 2.0, nbytes, "NVIDIA H200").endswith("= 43% of the 4.80 TB/s peak")
    for other in ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"):
        assert bench_kernels.bandwidth_line("loss", 2.0, nbytes, other).endswith("2060.5 GB/s")


def test_bench_kernels_times_the_cpu_head_on_a_cpu():
    """--only cpu_head runs without a GPU: the fused and unfused head, fp32 and bf16, each a figure."""
    out = run_script("tests/bench_kernels.py", "--only", "cpu_head", "--tokens", "24")
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [r[:2] for r in rows] == [["float32", "fused"], ["float32", "unfused"], ["bfloat16", "fused"],
                                     ["bfloat16", "unfused"]]
    assert all(float(r[2]) > 0 and r[3] == "ms" for r in rows)
    assert "24 x 128 x 50304" in out


def test_run_sh_bench_dry_run(monkeypatch):
    out = subprocess.run(["bash", "run.sh", "bench", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHON=sys.executable))  # this interpreter: no .venv, no install
    assert out.returncode == 0, out.stderr
    cmds = [line for line in out.stdout.splitlines() if line.startswith("bench: ")]
    if torch.cuda.is_available():
        assert any("step_timing.py" in c and "torch.distributed.run" in c for c in cmds)
    else:
        assert [c.split()[2] for c in cmds] == ["tests/bench_kernels.py", "tests/bench_optimizer.py",
                                                "tests/benchmarks/token_efficiency.py", "tests/benchmarks/token_efficiency.py",
                                                "tests/benchmarks/stage_rise.py", "tests/benchmarks/host_dispatch.py",
                                                "tests/benchmarks/call_depth.py", "tests/benchmarks/step_timing.py"]
    assert "need a CUDA GPU" in out.stdout
    mains = {"tests/benchmarks/token_efficiency.py": te.main, "tests/benchmarks/stage_rise.py": stage_rise.main}
    monkeypatch.chdir(REPO)  # the commands name their folders from the repository
    for c in cmds[2:5]:  # the committed tables print without training (each script's main, in this process)
        script, *argv = c.split()[2:]  # "bench: PYTHON SCRIPT ARGS..."
        folder = argv[-2] if c.endswith("--no_plot") else argv[-1]
        assert os.path.isdir(folder), folder
        printed = run_main(mains[script], *argv)
        assert "ratio: " in printed or "walks" in printed, c


def test_mfu_peak_is_known_for_the_h100_sxm_and_the_h200_only(monkeypatch):
    """989.4 TFLOP/s dense bf16 on the H100 SXM and the H200 (NVIDIA's data sheets); a PCIe H100 (756) or
    any other GPU is unknown unless --peak_tflops says it, and the override wins."""
    cuda = torch.device("cuda")
    for name, want in (("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H200", 989.4), ("NVIDIA H100 PCIe", None),
                       ("NVIDIA A100-SXM4-80GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert step_timing.peak_tflops(cuda, None) == want, name
    assert step_timing.peak_tflops(cuda, 500.0) == 500.0
    assert step_timing.peak_tflops(torch.device("cpu"), None) is None
