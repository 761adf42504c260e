"""Weights moved into one huge-page allocation after load (qrun/huge_pages.py)."""

from __future__ import annotations

import torch
from torch import nn

from qrun import huge_pages


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 48)
        self.tied = nn.Linear(64, 48, bias=False)
        self.tied.weight = self.linear.weight  # one parameter, two holders
        self.register_buffer("table", torch.arange(100, dtype=torch.int16).view(10, 10))
        base = torch.randn(4, 1000)
        self.planes = (base[1], torch.randint(0, 255, (7,), dtype=torch.uint8), None)  # a view into a larger storage
        self.row = base[2]  # another view of the same storage
        self.other_device = torch.empty(3, device="meta")


def test_every_cpu_tensor_moves_into_one_buffer_with_its_values_and_sharing_kept(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: True)
    model = Holder()
    tensors = {"weight": model.linear.weight, "bias": model.linear.bias, "table": model.table,
               "plane": model.planes[0], "codes": model.planes[1], "row": model.row}
    before = {name: t.clone() for name, t in tensors.items()}
    old_storages = {name: t.untyped_storage().data_ptr() for name, t in tensors.items()}
    offsets = {name: t.storage_offset() * t.element_size() for name, t in tensors.items()}
    moved = huge_pages.move_to_huge_pages(model)
    # each storage once, on a cache line: weight, bias, table, codes, and the views' whole storage
    assert moved == sum(-(-n // 64) * 64 for n in (48 * 64 * 4, 48 * 4, 100 * 2, 7, 4 * 1000 * 4))
    assert all(torch.equal(tensors[name], before[name]) for name in tensors)
    assert model.tied.weight is model.linear.weight and model.planes[0] is tensors["plane"]
    buffer = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(buffer) == 1 and buffer.isdisjoint(old_storages.values())
    # the two views of one storage stay views of one copy, 1000 floats apart
    assert model.row.data_ptr() - model.planes[0].data_ptr() == 1000 * 4
    copies = [t.data_ptr() - offsets[name] for name, t in tensors.items()]  # where each storage's copy begins
    assert min(copies) % huge_pages.HUGE_PAGE == 0 and all(c % 64 == 0 for c in copies)
    assert model.other_device.device.type == "meta"


def test_resident_bytes_count_each_allocation_once_opaque_packed_ones_included():
    model = Holder()
    # weight (tied), bias, table, codes and the views' one storage; nothing for the meta tensor
    plain = 48 * 64 * 4 + 48 * 4 + 100 * 2 + 7 + 4 * 1000 * 4
    assert huge_pages.resident_bytes(model) == plain
    model.packed = torch.randn(32, 16).to_mkldnn()  # oneDNN's layout: no storage to ask
    model.packed_param = nn.Parameter(model.packed, requires_grad=False)  # another object, the same memory
    assert huge_pages.resident_bytes(model) == plain + 32 * 16 * 4


def test_nothing_moves_where_the_kernel_gives_no_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    model = Holder()
    pointer = model.linear.weight.data_ptr()
    assert huge_pages.move_to_huge_pages(model) == 0
    assert model.linear.weight.data_ptr() == pointer
