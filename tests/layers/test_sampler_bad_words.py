"""bad_words masking (vLLM's rule): a word's last token is masked when the *output* ends with the
word's other tokens; a one-token word always. Prompt tokens never count toward a prefix."""
from __future__ import annotations

from pagedllm.layers.sampler import SamplingRow
from pagedllm.layers.sampling_inputs import bad_word_hits
from pagedllm.sampling_params import SamplingParams


def test_prefix_must_end_the_output_not_the_prompt():
    params = SamplingParams()
    params.bad_words_token_ids = [[5], [1, 2, 7], [9, 8]]
    rows = [SamplingRow(params, [1, 2, 3, 1, 2], 3, None),  # output [1, 2]: 5 and 7
            SamplingRow(params, [9, 1, 2], 1, None),  # output [1, 2]: 5 and 7
            SamplingRow(params, [9], 1, None),  # 9 is the prompt's: only 5
            SamplingRow(params, [1, 9], 1, None),  # output [9]: 5 and 8
            SamplingRow(SamplingParams(), [1, 2], 0, None)]  # no bad words: untouched
    assert sorted(bad_word_hits(rows)) == [(0, 5), (0, 7), (1, 5), (1, 7), (2, 5), (3, 5), (3, 8)]  # row 4: none
