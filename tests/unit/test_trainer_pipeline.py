"""Pipeline stages' weights: each stage's part of the model under megatron's local layer numbers, and back."""
from rlfleet.trainer.pipeline import global_names, stage_part

FULL = {
    "embedding.word_embeddings.weight": "E",
    **{f"decoder.layers.{i}.mlp.linear_fc1.weight": f"L{i}" for i in range(4)},
    "decoder.final_layernorm.weight": "N",
}


def test_each_stage_holds_its_layers_under_local_numbers_and_the_ends_their_extras():
    first = stage_part(FULL, 0, 2, 4, tied=True)
    last = stage_part(FULL, 1, 2, 4, tied=True)
    assert first == {"embedding.word_embeddings.weight": "E", "decoder.layers.0.mlp.linear_fc1.weight": "L0",
                     "decoder.layers.1.mlp.linear_fc1.weight": "L1"}
    # With tied embeddings the last stage keeps a copy of the embedding as its output weight.
    assert last == {"decoder.layers.0.mlp.linear_fc1.weight": "L2", "decoder.layers.1.mlp.linear_fc1.weight": "L3",
                    "decoder.final_layernorm.weight": "N", "output_layer.weight": "E"}
    middle = stage_part(FULL, 1, 4, 4, tied=True)
    assert middle == {"decoder.layers.0.mlp.linear_fc1.weight": "L1"}


def test_the_stages_renamed_back_are_the_whole_model_once():
    for stages, tied in ((2, True), (4, True), (2, False)):
        full = dict(FULL, **({} if tied else {"output_layer.weight": "O"}))
        merged: dict = {}
        for stage in range(stages):
            part = global_names(stage_part(full, stage, stages, 4, tied), stage, stages, 4, tied)
            assert not set(part) & set(merged), "a weight is on two stages"
            merged.update(part)
        assert merged == full
