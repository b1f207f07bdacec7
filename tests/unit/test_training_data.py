"""generate_data on a tiny model: shards hold the greedy response, its final hidden states and greedy next tokens."""

import torch
from tiny import hf_greedy, tiny_loaded

from draft_service.training.dataset import iter_sequences, load_sequences
from draft_service.training.generate_data import build_shard, count_mismatches, eos_ids, shard_path, write_shard


def test_shard_round_trip_matches_unbatched_greedy_and_forward(tmp_path):
    loaded = tiny_loaded(seed=1)
    prompts = [{"index": i, "kind": "t", "prompt": p} for i, p in
               enumerate(["hi", "a longer prompt here", "abc", "what is up with this", "z"])]
    pad_id = loaded.tokenizer.eos_token_id
    tensors, stats = build_shard(loaded, prompts, max_new_tokens=8, batch_size=2, pad_id=pad_id,
                                 eos=eos_ids(loaded))
    write_shard(shard_path(tmp_path, 0), tensors, stats)
    assert stats["mismatches"] == 0 and stats["checked"] > 0
    seqs = load_sequences(tmp_path)
    assert [s.prompt_index for s in seqs] == [0, 1, 2, 3, 4]
    for p, s in zip(prompts, seqs):
        token_ids, features, target_next, response_start = s
        prompt_ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}],
                                                          add_generation_prompt=True)
        prompt_ids = list(prompt_ids if isinstance(prompt_ids, list) else prompt_ids["input_ids"])
        assert token_ids.dtype == target_next.dtype == torch.int32 and features.dtype == torch.float16
        assert token_ids[:response_start].tolist() == prompt_ids
        expected = hf_greedy(loaded.model, prompt_ids, 8)
        if loaded.tokenizer.eos_token_id in expected:
            expected = expected[:expected.index(loaded.tokenizer.eos_token_id) + 1]
        assert token_ids[response_start:].tolist() == expected
        with torch.no_grad():
            out = loaded.model(token_ids[None].long(), output_hidden_states=True)
        torch.testing.assert_close(features.float(), out.hidden_states[-1][0], atol=2e-2, rtol=2e-3)
        assert torch.equal(target_next.long(), out.logits[0].argmax(-1))
        assert count_mismatches(token_ids, target_next, response_start) == (0, len(expected))
    assert len(list(iter_sequences(tmp_path))) == 5
