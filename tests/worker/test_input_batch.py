"""InputBatch rows and ModelRunner._prepare_inputs (worker/step_inputs.py), to the exact
slot, on hand-built SchedulerOutputs (block_size 4, no model: input preparation reads
only the batch)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.contracts import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.core.kv_groups import build_kv_cache_layout
from pagedllm.models.layers.linear import StepRows
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.step_inputs import StepInputs

BLOCK_SIZE = 4
MAX_NUM_REQS = 4
MAX_MODEL_LEN = 32
VOCAB = 256


def make_batch() -> InputBatch:
    max_blocks = -(-(MAX_MODEL_LEN + 1) // BLOCK_SIZE)
    return InputBatch(MAX_NUM_REQS, MAX_MODEL_LEN, max_blocks, VOCAB, torch.device("cpu"))


def make_runner(batch: InputBatch) -> ModelRunner:
    """A ModelRunner without a model or KV cache: `_update_states` and `_prepare_inputs`
    read only the input batch, the block size and the device (loading even a tiny model
    would build the native CPU kernels first)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.input_batch, runner.block_size = batch, BLOCK_SIZE
    runner.device = torch.device("cpu")
    runner.graphs = None  # CUDA graphs: none on CPU
    runner._unread = []  # async scheduling: no step launched and unread
    runner.lora = None  # LoRA off
    runner.images = None  # a model without images
    runner.kv_layout = build_kv_cache_layout([None], MAX_MODEL_LEN)
    # As where the quantized GEMM runs prompt rows on other kernels: the metadata marks
    # them (worker/prompt_rows.py).
    runner._step_rows = StepRows()
    return runner


def new_req(req_id: str, prompt: list[int], block_ids: list[int], num_computed: int = 0,
            output: list[int] | None = None) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt,
                          output_token_ids=output or [],
                          sampling_params=SamplingParams(temperature=0, logprobs=2),
                          block_ids=[block_ids], num_computed_tokens=num_computed)


def step(new: list[NewRequestData], cached: list[CachedRequestData],
         num_scheduled: dict[str, int], finished: tuple[str, ...] = ()) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           finished_req_ids=set(finished))


# Prompts: token ids tell requests and positions apart (x: 100.., b: 200.., ...).
PROMPT_X = list(range(100, 114))  # 14 tokens
PROMPT_B = list(range(200, 206))  # 6 tokens
PROMPT_C = list(range(300, 320))  # 20 tokens
PROMPT_A = list(range(400, 410))  # 10 tokens


def first_step() -> SchedulerOutput:
    """x: new, 3 cached blocks (12 tokens) of prefix hit, its last 2 prompt tokens.
    b: new, its whole 6-token prompt. c: new, the first 8-token chunk of 20."""
    return step([new_req("x", PROMPT_X, [12, 13, 14, 15], num_computed=12),
                 new_req("b", PROMPT_B, [2, 5]),
                 new_req("c", PROMPT_C, [4, 6])], [],
                {"x": 2, "b": 6, "c": 8})


def second_step() -> SchedulerOutput:
    """x finished; b decodes its sampled token; c prefills its next 5 prompt tokens
    (crossing into a new block); a: new, 2 cached blocks (8 tokens) of prefix hit."""
    return step([new_req("a", PROMPT_A, [7, 3, 9], num_computed=8)],
                [CachedRequestData("b", new_block_ids=[[]], num_computed_tokens=6),
                 CachedRequestData("c", new_block_ids=[[8, 11]], num_computed_tokens=8)],
                {"b": 1, "c": 5, "a": 2}, finished=("x",))


def check_step(inputs: StepInputs, *, req_ids, input_ids, positions, slot_mapping,
               query_start_loc, seq_lens, block_table, logits_indices, sample_rows,
               sample_positions) -> None:
    md = inputs.attn_metadata
    assert inputs.req_ids == req_ids
    assert inputs.input_ids.tolist() == input_ids
    assert inputs.positions.tolist() == positions
    assert md.slot_mapping.tolist() == slot_mapping
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu.tolist() == query_start_loc
    assert md.seq_lens.tolist() == md.seq_lens_cpu.tolist() == seq_lens
    assert md.block_table.tolist() == block_table
    assert md.query_start_loc.dtype == md.seq_lens.dtype == md.block_table.dtype == torch.int32
    assert (md.num_reqs, md.num_actual_tokens) == (len(req_ids), len(positions))
    assert md.max_query_len == max(np.diff(query_start_loc))
    assert md.max_seq_len == max(seq_lens)
    if logits_indices is None:  # every token samples: no gather
        assert inputs.logits_indices is None
    else:
        assert inputs.logits_indices.tolist() == logits_indices
    assert inputs.sample_rows.tolist() == sample_rows
    assert inputs.sample_positions.tolist() == sample_positions


def test_prepare_inputs_of_a_mixed_batch_across_two_steps():
    batch = make_batch()
    runner = make_runner(batch)
    so = first_step()
    runner._update_states(so)
    inputs = runner._prepare_inputs(so)
    # slot = block_table[pos // 4] * 4 + pos % 4; x's positions 12, 13 are in block 15.
    check_step(inputs, req_ids=["x", "b", "c"],
               input_ids=PROMPT_X[12:] + PROMPT_B + PROMPT_C[:8],
               positions=[12, 13, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7],
               slot_mapping=[60, 61, 8, 9, 10, 11, 20, 21, 16, 17, 18, 19, 24, 25, 26, 27],
               query_start_loc=[0, 2, 8, 16], seq_lens=[14, 6, 8],
               # max_seq_len 14 -> 4 block columns; unused entries are the null block 0.
               block_table=[[12, 13, 14, 15], [2, 5, 0, 0], [4, 6, 0, 0]],
               # x and b finish their prompts and sample; c is mid-prompt and does not.
               logits_indices=[1, 7], sample_rows=[0, 1], sample_positions=[0, 1])
    batch.append_sampled(inputs.sample_rows, np.array([150, 250]))  # as execute_model does

    so = second_step()
    runner._update_states(so)
    inputs = runner._prepare_inputs(so)
    # a reuses x's freed row 0; b decodes position 6 (its sampled token 250) in block 5;
    # c's positions 8..11 fill block 8 and position 12 starts block 11.
    check_step(inputs, req_ids=["b", "c", "a"],
               input_ids=[250] + PROMPT_C[8:13] + PROMPT_A[8:],
               positions=[6, 8, 9, 10, 11, 12, 8, 9],
               slot_mapping=[22, 32, 33, 34, 35, 44, 36, 37],
               query_start_loc=[0, 1, 6, 8], seq_lens=[7, 13, 10],
               block_table=[[2, 5, 0, 0], [4, 6, 8, 11], [7, 3, 9, 0]],
               logits_indices=[0, 7], sample_rows=[1, 0], sample_positions=[0, 2])
    # b's decode is a generated row; c's and a's tokens are prompt tokens.
    assert inputs.attn_metadata.prompt_rows.tolist() == [False] + [True] * 7


def test_placeholders_take_the_unread_steps_sampled_ids():
    """Async scheduling: b and c sampled in a launched step whose ids are unread; the
    next step decodes both at the position after their known tokens, and their input
    ids come from that step's sampled tensor: by one copy when the order matches, by
    index otherwise. A decode-only step gathers no logits rows (logits_indices None)."""
    from pagedllm.worker.deferred_sample import DeferredSample, HostCopy

    batch = make_batch()
    runner = make_runner(batch)
    so = step([new_req("b", PROMPT_B, [2, 5]), new_req("c", PROMPT_C[:7], [4, 6])], [],
              {"b": 6, "c": 7})
    runner._update_states(so)
    first = runner._prepare_inputs(so)
    rows = first.sample_rows
    sampled = torch.tensor([250, 350])
    runner._unread = [DeferredSample(
        sampled=sampled, copy=HostCopy(sampled), rows=rows,
        generations=batch.generation[rows], positions=first.sample_positions,
        logprobs=None, num_logprobs=np.full(2, -1))]
    for order, expected in ((("b", "c"), [250, 350]), (("c", "b"), [350, 250])):
        computed = {"b": 6, "c": 7}
        so = step([], [CachedRequestData(r, new_block_ids=[[]],
                                         num_computed_tokens=computed[r]) for r in order],
                  {r: 1 for r in order})
        runner._update_states(so)
        inputs = runner._prepare_inputs(so)
        assert inputs.input_ids.tolist() == expected
        assert inputs.positions.tolist() == [computed[r] for r in order]
        assert inputs.logits_indices is None
        assert inputs.sample_positions.tolist() == [0, 1]
    # b finished meanwhile (its row freed, so no longer the sample's): c, alone now,
    # still takes its own sample (by index: it was second in the launched step).
    runner._update_states(step([], [], {}, finished=("b",)))
    so = step([], [CachedRequestData("c", new_block_ids=[[]], num_computed_tokens=7)],
              {"c": 1})
    runner._update_states(so)
    assert runner._prepare_inputs(so).input_ids.tolist() == [350]


def test_prepare_inputs_of_a_prompt_resumed_after_preemption():
    # Recomputed like a prompt: the tokens sampled before preemption follow the prompt
    # in token_ids, and sampling waits until all of them are computed again.
    batch = make_batch()
    runner = make_runner(batch)
    so = step([new_req("r", [1, 2, 3], [5, 6], output=[7, 8, 9])], [], {"r": 4})
    runner._update_states(so)
    inputs = runner._prepare_inputs(so)
    check_step(inputs, req_ids=["r"], input_ids=[1, 2, 3, 7],
               positions=[0, 1, 2, 3], slot_mapping=[20, 21, 22, 23],
               query_start_loc=[0, 4], seq_lens=[4], block_table=[[5]],
               logits_indices=[], sample_rows=[], sample_positions=[])
    # The recomputed tokens stay generated rows, as when they were first computed.
    assert inputs.attn_metadata.prompt_rows.tolist() == [True, True, True, False]
    so = step([], [CachedRequestData("r", new_block_ids=[[]], num_computed_tokens=4)],
              {"r": 2})
    runner._update_states(so)
    inputs = runner._prepare_inputs(so)
    check_step(inputs, req_ids=["r"], input_ids=[8, 9],
               positions=[4, 5], slot_mapping=[24, 25], query_start_loc=[0, 2],
               seq_lens=[6], block_table=[[5, 6]], logits_indices=[1], sample_rows=[0],
               sample_positions=[0])
    assert inputs.attn_metadata.prompt_rows is None  # no prompt row: one path for all


def test_add_request_fills_its_row():
    batch = make_batch()
    row = batch.add_request(new_req("r", [11, 12, 13], [5, 6], num_computed=0,
                                    output=[14, 15]))
    assert row == 0 and batch.req_id_to_row == {"r": 0}
    assert batch.token_ids[0, :6].tolist() == [11, 12, 13, 14, 15, 0]
    assert (batch.num_tokens[0], batch.num_prompt_tokens[0]) == (5, 3)
    assert batch.num_computed_tokens[0] == 0
    assert batch.block_tables[0, 0, :3].tolist() == [5, 6, 0] and batch.num_blocks[0, 0] == 2
    assert batch.sampling.num_logprobs[0] == 2
    batch.append_blocks(0, [[9]])
    assert batch.block_tables[0, 0, :4].tolist() == [5, 6, 9, 0] and batch.num_blocks[0, 0] == 3


def test_append_sampled_extends_each_row():
    batch = make_batch()
    batch.add_request(new_req("a", [1, 2], [1]))
    batch.add_request(new_req("b", [3, 4, 5], [2]))
    batch.append_sampled(np.array([1, 0]), np.array([50, 60]))
    assert batch.token_ids[0, :4].tolist() == [1, 2, 60, 0]
    assert batch.token_ids[1, :5].tolist() == [3, 4, 5, 50, 0]
    assert batch.num_tokens[:2].tolist() == [3, 4]
    assert batch.num_prompt_tokens[:2].tolist() == [2, 3]


def test_rows_are_reused_not_condensed():
    batch = make_batch()
    for i, req_id in enumerate("abc"):
        assert batch.add_request(new_req(req_id, [i], [i + 1, i + 5, i + 9])) == i
    batch.remove_request("a")
    batch.remove_request("b")
    # Survivors keep their rows; the most recently freed row is taken first.
    assert batch.req_id_to_row == {"c": 2}
    assert batch.add_request(new_req("d", [7], [20])) == 1
    assert batch.add_request(new_req("e", [8], [21])) == 0
    assert batch.add_request(new_req("f", [9], [22])) == 3
    assert batch.req_id_to_row == {"c": 2, "d": 1, "e": 0, "f": 3}
    # A reused row pads with the null block, not with its previous request's blocks,
    # and forgets that request's sampling settings.
    assert batch.block_tables[0, 1, :3].tolist() == [20, 0, 0] and batch.num_blocks[0, 1] == 1
    assert batch.block_tables[0, 0, :3].tolist() == [21, 0, 0]
    batch.remove_request("e")
    assert batch.sampling.num_logprobs[0] == -1 and not batch.block_tables[:, 0].any()
    batch.remove_request("unknown")  # finished before it ever reached the runner
    assert batch.req_id_to_row == {"c": 2, "d": 1, "f": 3}


def test_prepare_inputs_with_a_sliding_window_group():
    # Layers 0, 2 full attention, 1, 3 a window of 5 keys: groups (full, 5). Request r
    # has 13 tokens computed (positions 0..12) and decodes position 13, whose window is
    # keys 9..13: blocks 0 and 1 (positions 0..7) are out of every later query's window
    # (the scheduler gave them back: 0), block 2 (8..11) is not.
    batch = InputBatch(MAX_NUM_REQS, MAX_MODEL_LEN, -(-(MAX_MODEL_LEN + 1) // BLOCK_SIZE),
                       VOCAB, torch.device("cpu"), num_kv_groups=2)
    runner = make_runner(batch)
    runner.kv_layout = build_kv_cache_layout([None, 5, None, 5], MAX_MODEL_LEN)
    assert runner.kv_layout.group_windows == (None, 5)
    new = new_req("r", list(range(14)), [])
    new.block_ids, new.num_computed_tokens = [[1, 2, 3, 4], [0, 6, 7, 8]], 13
    so = step([new], [], {"r": 1})
    runner._update_states(so)
    md = runner._prepare_inputs(so).attn_metadata
    assert md.for_group(0) is md and md.block_table.tolist() == [[1, 2, 3, 4]]
    assert md.slot_mapping.tolist() == [4 * 4 + 1]
    window = md.for_group(1)
    # Block 1 (id 6) is still in the runner's table but the metadata nulls it.
    assert window.block_table.tolist() == [[0, 0, 7, 8]]
    assert window.slot_mapping.tolist() == [8 * 4 + 1]
    assert window.seq_lens.tolist() == md.seq_lens.tolist() == [14]
    # Next step: position 14, window 10..14: block 2 (8..11) still seen.
    so = step([], [CachedRequestData("r", new_block_ids=[[], []], num_computed_tokens=14)],
              {"r": 1})
    runner._update_states(so)
    batch.append_sampled(np.array([0]), np.array([14]))
    window = runner._prepare_inputs(so).attn_metadata.for_group(1)
    assert window.block_table.tolist() == [[0, 0, 7, 8]]


def test_prepare_inputs_gives_each_token_its_lora_adapter():
    """With LoRA on: each token's adapter id (0 for the base model), rows freed and
    reused lose theirs; a step whose requests have none gets None (no LoRA pass)."""
    from dataclasses import replace

    from pagedllm.lora_request import LoRARequest

    batch = make_batch()
    runner = make_runner(batch)
    runner.lora = object()  # LoRA on (the manager itself is not used here)
    lora = LoRARequest("a", 7, "/adapters/a")
    so = first_step()
    so.scheduled_new_reqs[1] = replace(so.scheduled_new_reqs[1], lora_request=lora)
    runner._update_states(so)
    inputs = runner._prepare_inputs(so)
    # x: 2 tokens, b (adapter 7): 6, c: 8.
    assert inputs.lora_ids.tolist() == [0] * 2 + [7] * 6 + [0] * 8
    assert inputs.loras == {7: lora}
    base_only = step([], [CachedRequestData("c", new_block_ids=[[8, 11]],
                                            num_computed_tokens=8)], {"c": 5},
                     finished=("x", "b"))
    runner._update_states(base_only)
    base_inputs = runner._prepare_inputs(base_only)
    assert base_inputs.lora_ids is None and base_inputs.loras is None
    assert not batch.lora_ids.any() and not batch.loras
