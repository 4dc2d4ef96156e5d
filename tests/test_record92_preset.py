"""The record92 preset against record #92's own constants and shapes (its certification log, which embeds
the source: the depth and width sets, the injection sets, the banks' shapes at 8 GPUs), and what its dry
run prints."""
import torch

import train_gpt as tg

RECORD92 = tg.parse_args(["--preset", "record92"])

# record #92's constants: SKIP_LAYERS {7}, SKIP_ATTN_LAYERS {4, 9}, the wide carriers (3, 10), the d_v 64 layers
# (1, 4, 7, 8) of which 1 and 8 have attention, _NOINJ_X0 {3, 8, 9}, _NOINJ_BG {2, 3, 7, 8}, the paired layers
# (0, 2, 5), value embeddings on 1, 2, 8, 10, the parallel MLP on 8, the skip on 6, MUDD gate 1 from 4
LAYERS = range(11)
REMOVED, NO_ATTENTION, WIDE, V64, PAIRED = {7}, {4, 9}, {3, 10}, {1, 8}, {0, 2, 5}
NO_X0, NO_NGRAM = {3, 8, 9}, {2, 3, 7, 8}


def test_record92_rows_are_record_92s_sets():
    rows = RECORD92.layers
    attention = {i for i in LAYERS if rows[i].has_attention}
    assert attention == set(LAYERS) - REMOVED - NO_ATTENTION - {6} and rows[6].attention == "none"
    assert {i for i in LAYERS if not rows[i].mlp} == REMOVED
    assert {i for i in LAYERS if rows[i].attention == "paired"} == PAIRED
    assert {i for i in LAYERS if rows[i].narrow_qk} == attention - WIDE
    assert {i for i in LAYERS if rows[i].narrow_v} == V64
    assert {i for i in LAYERS if rows[i].key_offset} == WIDE and {i for i in LAYERS if rows[i].window == "long"} == WIDE
    injected = set(LAYERS) - {6, 10}  # the skip row adds neither; the mudd row's come from MUDD
    assert {i for i in injected if rows[i].x0} == injected - NO_X0
    assert {i for i in injected if rows[i].ngram} == injected - NO_NGRAM
    assert {i for i in LAYERS if rows[i].value_embed} == {1, 2, 8, 10}
    assert {i for i in LAYERS if rows[i].parallel_mlp} == {8}
    assert [i for i in LAYERS if rows[i].post_gates] == [4] and [i for i in LAYERS if rows[i].save_h] == [7]
    assert [i for i in LAYERS if rows[i].save_skip] == [3] and rows[10].mudd and rows[10].dc
    assert {i for i in LAYERS if rows[i].input == "h"} == {8, 10}  # norm(cache[7]) on 8 and 10 (9: no attention)


def test_record92_shapes_at_8_gpus_are_record_92s():
    """At 8 ranks (padded banks) and #92's 84,602,880 table rows, built on the meta device: qk (48, 256, 768)
    with 42 live groups, vo (16, 768, 768) with 14 live, the MLP bank's 12 (c_fc, c_proj) slots of 2816 x 768,
    four value-embedding planes, #92's table, the head and embedding, mudd_w2g (14, 12, 64)."""
    args = tg.parse_args(["--preset", "record92", "--ngram_rows", "84602880"])
    with torch.device("meta"):
        model = tg.GPT(args, world_size=8)
    shapes = {label: tuple(p.shape) for label, p in model.params_by_label().items()}
    assert shapes["qk_bank"] == (48, 256, 768) and model.bank_roles["qk_bank"].count("pad") == 6
    assert shapes["vo_bank"] == (16, 768, 768) and model.bank_roles["vo_bank"].count("pad") == 2
    assert shapes["mlp_bank"] == (24, 2816, 768) and model.bank_roles["mlp_bank"][22:] == ["parallel_up.8",
                                                                                             "parallel_down.8"]
    assert shapes["value_embeds"] == (4, 50304, 768) and shapes["bigram_embed"] == (84_602_880, 768)
    assert shapes["lm_head"] == (768, 50304) and shapes["embed"] == (50304, 768)
    assert shapes["mudd_w1"] == (2, 64, 768) and shapes["mudd_w2"] == (2, 14, 64) and shapes["mudd_w2g"] == (14, 12, 64)
    configs = tg.optimizer_configs(args, model)
    assert configs["mlp_bank"].matrix_lr_mul[14:16] == (0.0, 0.0)  # layer 7's slots: lr 0
    assert configs["bigram_embed"].optimizer == "row_adam" and configs["bigram_embed"].lr_mul == 70.0
    assert configs["value_embeds"].lr_mul == 70.0 and configs["qk_bank"].optimizer == "anvil"


def test_record92_dry_run_prints_its_stages_and_classes():
    report = tg.dry_run_report(RECORD92)
    lines = report.splitlines()
    assert lines[0] == "steps: 1194; stage ends: 0, 320, 681, 1107, 1174, 1194"
    assert lines[1] == ("training softmax classes: 10240 from step 0, 14336 from step 681, 24576 from step 965,"
                        " all 50304 from step 1107")
    assert "bigram_embed     (16000000, 768)" in report
