"""Comparing two greedy runs of the same model at two precisions (a quantized path, an fp8
KV cache, another build of the kernels) where the bundled Q4_1 model meets near-ties
early: where the runs part is a matter of the machine's last bits, so what is checked is
how they part, not when."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams

# {token: logprob} of the top 5 at each generated position.
Dists = list[dict[int, float]]


def greedy_dists(llm: LLM, prompts: list, max_tokens: int) -> list[tuple[list[int], Dists]]:
    """Each prompt's greedy tokens and, per position, the top 5 tokens' logprobs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def assert_near_tie_partings(base: list[tuple[list[int], Dists]],
                             other: list[tuple[list[int], Dists]], max_diff: float,
                             max_gap: float) -> list[int]:
    """While each pair of runs agrees, the sampled tokens' logprobs differ by at most
    `max_diff`; where they part, `other`'s token is among `base`'s top 5 within `max_gap`
    logprob of `base`'s choice (a near-tie of the reference). Returns how many tokens each
    pair agreed on."""
    agreed, diff, gaps = [], 0.0, []
    for (tokens, dists), (other_tokens, other_dists) in zip(base, other, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(tokens, other_tokens)) if a != b),
                 len(tokens))
        agreed.append(n)
        diff = max([diff] + [abs(d[t] - o[t]) for d, o, t in
                             zip(dists[:n], other_dists, tokens)])
        if n < len(tokens):
            gaps.append(dists[n][tokens[n]] - dists[n].get(other_tokens[n], float("-inf")))
    assert diff <= max_diff, (diff, agreed)
    assert all(gap <= max_gap for gap in gaps), (gaps, agreed)
    return agreed
