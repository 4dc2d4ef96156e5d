"""Record #92's sampled softmax (--sampled_softmax): the candidate set against a loop over the stride
sweep, the loss and the head's gradient against float64, every class as the full softmax to the bit,
and the candidate count by step at #92's numbers."""
import math

import numpy as np
import pytest
import torch

import train_gpt as tg
from test_model import bigrams, make_batch, randomize
from test_triton_kernels import ce_record_float64, sigma_bf16_float64

TEST = tg.parse_args(["--preset", "test"])
V = TEST.padded_vocab_size


def sweep_loop(targets, P, V, stride=20011):
    """The set written out: the distinct targets, then k = start, start + 1, ... of stride * k mod V,
    each class not yet in the set, until P classes."""
    chosen = sorted(set(int(t) for t in targets))
    have, k = set(chosen), int(sum(int(t) for t in targets)) % V
    while len(chosen) < P:
        c = stride * k % V
        if c not in have:
            have.add(c)
            chosen.append(c)
        k += 1
    return sorted(chosen)


def test_the_stride_sweep_is_a_permutation_of_the_vocabulary():
    assert math.gcd(20011, 50304) == 1
    assert sorted(20011 * k % 50304 for k in range(50304)) == list(range(50304))


@pytest.mark.parametrize("T, P", [(200, 256), (2000, 2048), (2000, 10240), (600, 50304)])
def test_candidate_set_is_every_target_then_the_sweep(T, P):
    g = np.random.default_rng(T + P)
    targets = g.integers(0, 50257, T)
    targets[: T // 4] = targets[0]  # repeated targets count once
    got = tg.candidate_classes(targets, P, V)
    assert got.dtype == torch.int64 and got.tolist() == sweep_loop(targets, P, V)
    assert len(set(got.tolist())) == P and torch.all(got[1:] > got[:-1])  # sorted, duplicate-free
    assert set(targets.tolist()) <= set(got.tolist())
    assert torch.equal(tg.candidate_classes(targets.copy(), P, V), got)  # a function of the micro-batch alone


def test_candidate_set_refuses_too_few_classes():
    with pytest.raises(ValueError, match=r"sampled softmax: P=3 classes must hold the micro-batch's 4 distinct"):
        tg.candidate_classes(np.array([1, 2, 3, 4]), 3, V)


def model_and_batch(seed=3):
    torch.manual_seed(0)
    model = tg.GPT(TEST, 1, dtype=torch.float32)
    randomize(model, seed=seed)
    model.prefix_table.copy_(tg.build_prefix_table(tg.gpt2_encoding(), V))
    inputs, targets, cu = make_batch(T=128, seed=seed)
    return model, inputs, targets, cu


def sampled_loss_and_grad(model, inputs, targets, cu, candidates, weights, prefix_weight, scale):
    model.zero_grad(set_to_none=True)
    loss, next_token = model(inputs, targets, cu, bigrams(inputs), mtp_weights=weights, loss_scale=scale,
                             prefix_weight=prefix_weight, candidates=candidates)
    loss.backward()
    return loss.detach(), next_token, model.lm_head.grad.clone()


def test_sampled_loss_and_head_gradient_against_float64():
    """The loss over the candidates' columns only, every MTP term sharing their normaliser, a prefix target
    outside them dropped with its weight; the head's gradient zero outside them, inside them the record's
    gradient in float64 (ce_record_float64 over the candidates' logits)."""
    model, inputs, targets, cu = model_and_batch()
    weights, pi, scale = torch.tensor([1.0, 0.5, 0.25]), torch.tensor(0.25), 1 / 128
    cand = tg.candidate_classes(targets.numpy(), 8192, V)
    loss, next_token, grad = sampled_loss_and_grad(model, inputs, targets, cu, cand, weights, pi, scale)
    index = {c: i for i, c in enumerate(cand.tolist())}
    prefix = model.prefix_table[targets]
    prefix_c = torch.tensor([index.get(int(p), -1) if p >= 0 else -1 for p in prefix])
    assert (prefix >= 0).sum() > (prefix_c >= 0).sum() > 0  # some prefixes are candidates, some are not
    with torch.no_grad():
        x = tg.final_hidden(model, inputs, cu, bigrams(inputs))
    logits = x.double() @ model.lm_head.detach().double()[:, cand]
    targets_c = torch.tensor([index[int(t)] for t in targets])
    rows, dlogits = ce_record_float64(logits, targets_c, weights.tolist(), prefix_c, float(pi), grad_scale=scale)
    assert loss.item() == pytest.approx(scale * rows.sum().item(), rel=1e-5)
    z = 23 * sigma_bf16_float64(logits)  # the kernels' stored sigma
    plain = (torch.logsumexp(z, 1) - z[torch.arange(len(targets)), targets_c]).sum()
    assert next_token.item() == pytest.approx(plain.item(), rel=1e-4)  # the next-token CE over the candidates
    outside = torch.ones(V, dtype=torch.bool)
    outside[cand] = False
    assert torch.count_nonzero(grad[:, outside]) == 0 and torch.count_nonzero(grad[:, cand]) > 0
    want = x.double().T @ dlogits
    assert ((grad[:, cand].double() - want).norm() / want.norm()).item() < 1e-5


def test_every_class_as_candidates_is_the_full_softmax_to_the_bit():
    model, inputs, targets, cu = model_and_batch(seed=4)
    weights, pi, scale = torch.tensor([1.0, 0.5]), torch.tensor(0.2), 1 / 128
    full = sampled_loss_and_grad(model, inputs, targets, cu, None, weights, pi, scale)
    every = sampled_loss_and_grad(model, inputs, targets, cu, tg.candidate_classes(targets.numpy(), V, V),
                                  weights, pi, scale)
    for a, b in zip(full, every):
        assert torch.equal(a, b)


def test_candidate_count_by_step_at_record_92s_numbers():
    """#92: 10,240 classes until step 681, 14,336 until 965, 24,576 until 1,107, then the full softmax, over
    1,194 scheduled steps; the batches carry the step's set, and the default is the full softmax."""
    n = 1194
    args = tg.parse_args(["--preset", "test", "--num_iterations", str(n), "--sampled_softmax",
                          f"((0, 10240), ({681 / n!r}, 14336), ({965 / n!r}, 24576), ({1107 / n!r}, 0))"])
    got = {s: tg.plan_step(args, s).candidates for s in (0, 680, 681, 964, 965, 1106, 1107, 1190)}
    assert got == {0: 10240, 680: 10240, 681: 14336, 964: 14336, 965: 24576, 1106: 24576, 1107: 0, 1190: 0}
    assert tg.batch_request(args, tg.plan_step(args, 0), 4, torch.device("cpu"))[-1] == (10240, V)
    assert tg.batch_request(args, tg.plan_step(args, 1107), 4, torch.device("cpu"))[-1] is None
    assert {tg.plan_step(tg.Hyperparameters(), s).candidates for s in (0, 900, 1280)} == {0}
    buf = np.arange(1000, 1600, dtype=np.uint16)
    batch = tg.make_batch(buf, TEST.ngram_rows, sampled=(1024, V))
    assert torch.equal(batch.candidates, tg.candidate_classes(buf[1:].astype(np.int64), 1024, V))
    staged = tg.unstage(batch, tg.stage_batch(batch).staged)  # staged with the batch's other tensors
    assert torch.equal(staged.candidates, batch.candidates)


@pytest.mark.parametrize("flags", [("--sampled_softmax", "((0, 1024),)"),  # the FP8 head trains on every class
                                   ("--fp8", "false", "--sampled_softmax", "((0, 1024.5),)"),
                                   ("--fp8", "false", "--sampled_softmax", "((0, 60000),)")])
def test_bad_sampled_softmax_flags_stop_with_one_line(flags):
    with pytest.raises(SystemExit, match=r"^error: --sampled_softmax .*: P must be an integer <= --padded_vocab_size,"
                                         r" and the FP8 head trains on every class \(add --fp8 false\)$"):
        tg.check_args(tg.parse_args(["--preset", "test", *flags]), 1)
