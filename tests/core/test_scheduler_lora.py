"""max_loras: the running requests use at most that many distinct LoRA adapters; a
waiting request with another adapter waits at the head of the queue (no skipping), and
requests of the base model or of a running adapter are not held back by it."""

from __future__ import annotations

from pagedllm.lora_request import LoRARequest


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}")


def test_adapters_per_step_are_capped(make_scheduler, make_request, step) -> None:
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=64)
    sched.max_loras = 2
    loras = {"a": _lora(1), "b": _lora(2), "c": _lora(1), "base": None, "d": _lora(3),
             "e": _lora(2)}
    for i, (name, lora) in enumerate(loras.items()):
        request = make_request(name, [100 * i + j for j in range(4)], max_tokens=2)
        request.lora_request = lora
        sched.add_request(request)
    output, _ = step(sched)
    # a (1), b (2), c (1 again), the base request; d (a third adapter) stops the queue,
    # so e (adapter 2, running) waits behind it.
    assert list(output.num_scheduled_tokens) == ["a", "b", "c", "base"]
    assert [r.lora_request for r in output.scheduled_new_reqs] == [
        loras["a"], loras["b"], loras["c"], None]
    seen = set()
    while sched.has_unfinished_requests():
        output, _ = step(sched)
        running = {r.lora_int_id for r in sched.running} - {0}
        assert len(running) <= 2
        seen |= set(output.num_scheduled_tokens)
    assert {"d", "e"} <= seen


def test_prefix_hashes_depend_on_the_adapter(make_request) -> None:
    from pagedllm.core.block_hash import update_block_hashes

    tokens = list(range(8))
    base, one, other = (make_request(n, tokens) for n in ("base", "one", "other"))
    one.lora_request, other.lora_request = _lora(1), _lora(2)
    hashes = [update_block_hashes(r, 4) for r in (base, one, other)]
    assert len({h[0] for h in hashes}) == 3
    again = make_request("again", tokens)
    again.lora_request = _lora(1)
    assert update_block_hashes(again, 4) == hashes[1]
