"""The representatives store: appends per layer, growth, the budget's release, copies."""

from __future__ import annotations

import pytest
import torch

from kvfs.torch.blocks import QuantizedKeys, centroids_of_keys
from kvfs.torch.representatives import Representatives, capacity

LAYERS, H, D, BLOCK = 3, 2, 8, 4


def _keys(blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(1, H, blocks * BLOCK, D, generator=torch.Generator().manual_seed(seed))


def test_appends_grow_by_a_quarter_and_keep_every_layer_apart() -> None:
    reps = Representatives(LAYERS, 2, block_bytes=100)
    assert not reps.held and reps.capacity == 0 and reps.growth_bytes(3) == capacity(3) * 100
    per_layer = {layer: [] for layer in range(LAYERS)}
    for step in range(12):  # three blocks a step, layers in turn as a model's steps add them
        for layer in range(LAYERS):
            c = centroids_of_keys(_keys(3, 100 * step + layer), BLOCK)
            reps.append(layer, c)
            per_layer[layer].append(c)
    assert reps.count == [36] * LAYERS
    assert 36 <= reps.capacity <= capacity(36)  # grown a few times, not once a step
    assert reps.device_bytes == reps.capacity * LAYERS * H * D * 2 * 4
    for layer in range(LAYERS):
        assert torch.equal(reps.centroids(layer), torch.cat(per_layer[layer]))
        one, scale = reps.first(5, layer)
        assert one.shape == (1, H, D, 10) and scale is None
    every, _ = reps.first(36)
    assert every.shape == (LAYERS, H, D, 72)
    span = reps.centroid_span(4, 9)  # the side stream's records: [blocks, layers, H, 2, D]
    for layer in range(LAYERS):
        assert torch.equal(span[:, layer], torch.cat(per_layer[layer])[4:9])
    assert reps.growth_bytes(reps.capacity) == 0 and reps.growth_bytes(reps.capacity + 1) > 0


def test_quantized_keys_keep_their_scales_beside_the_codes() -> None:
    sel = QuantizedKeys(BLOCK, 8, "sum")
    reps = Representatives(LAYERS, sel.columns(BLOCK), block_bytes=1)
    keys = _keys(5, 7)
    for layer in range(LAYERS):
        reps.append(layer, *sel.represent(keys, BLOCK))
    codes, scale = reps.first(5, 1)
    assert codes.dtype == torch.int8 and scale is not None and scale.shape == (1, H, 5 * BLOCK)
    # codes times scales give back the keys to int8's rounding, token by token
    back = (codes[0].float() * scale[0].unsqueeze(1)).permute(0, 2, 1)  # [H, T, D]
    assert torch.allclose(back, keys[0], atol=float(scale.max()) / 2 + 1e-6)


def test_the_budget_takes_the_tensors_and_leaves_the_count() -> None:
    reps = Representatives(LAYERS, 2, block_bytes=64)
    for layer in range(LAYERS):
        reps.append(layer, centroids_of_keys(_keys(6, layer), BLOCK))
    held = reps.device_bytes
    assert reps.refill_bytes == 0
    assert reps.release() == held > 0
    assert reps.out and not reps.held and reps.device_bytes == 0 and reps.count == [6] * LAYERS
    assert reps.refill_bytes == capacity(6) * 64
    assert reps.release() == 0  # nothing left to take
    with pytest.raises(RuntimeError):
        reps.first(6)
    reps.reset()  # a rebuild starts from nothing
    assert not reps.out and reps.count == [0] * LAYERS


def test_a_copy_is_its_own() -> None:
    reps = Representatives(LAYERS, 2, block_bytes=64)
    for layer in range(LAYERS):
        reps.append(layer, centroids_of_keys(_keys(2, layer), BLOCK))
    twin = reps.copy()
    for layer in range(LAYERS):
        twin.append(layer, centroids_of_keys(_keys(2, 50 + layer), BLOCK))
    assert reps.count == [2] * LAYERS and twin.count == [4] * LAYERS
    for layer in range(LAYERS):
        assert torch.equal(twin.centroids(layer)[:2], reps.centroids(layer))
    twin.release()
    assert reps.held and not reps.out
