"""The two-phase vision exchange: a real DDP step with images encoded on other ranks equals one process.

For world sizes 2, 3 and 4 (one set of gloo processes each, spawned once per module), global steps of
synthetic multimodal samples (random text, image-token placeholders, random Qwen2-VL pixel patches for
grids (1,4,4), (1,4,8), (1,8,8)) are planned with the real `batchd.core.plan_vision`, so images move
to other ranks for the encoder. Every rank builds its batch as batchd delivers it (`collate_padded` /
`collate_packed` of its LLM samples, the pixel values of its `Exchange.encode` images,
`exchange_arrays`), runs `TinyMLLM` under DDP with the loss scale N t_r / T_tok and backward. The loss
and every parameter's gradient must equal, within float32 rounding, a single process that runs each
rank's batch with its own images encoded in place (no exchange) and the global per-token loss.

Scenarios: images moved across ranks (padded), an image-free step (every exchange empty: the collective
still runs), one rank's LLM group holding every image (the plan spreads them; packed). A control swaps
two received images on one rank (same token count, so the arrays stay valid) and must differ from the
reference, so the comparison can fail. The exchange alone is checked against a pure-numpy reference:
forward delivers exactly each owner's images (each encoded exactly once, by the rank its `sources`
name), backward returns each encoder exactly the gradient rows of what it sent (the inverse
permutation). Single-process unit tests of argument validation, the one-rank path and the model sit at
the end.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _procs import gloo_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd import core
from batchd.client import exchange_image_embeddings, scaled_loss, token_loss_sum
from batchd.core import EXCHANGE_KEYS, Exchange, Sample, VisionCost, exchange_arrays, loss_scale, plan_vision
from batchd.testing import (
    IGNORE_INDEX,
    PATCH_DIM,
    TinyCausalLM,
    TinyMLLM,
    image_patches,
    phase_loads,
    to_torch,
)

WORLDS = (2, 3, 4)
SPAWN_DEADLINE_S = 300.0  # liveness backstop for a world's spawned ranks (`_procs.gloo_ranks`)
PG_TIMEOUT_S = 60
VOCAB = 64
IMG = 3  # the image placeholder id; text tokens are drawn from [4, VOCAB)
SMALL, WIDE, BIG = (1, 4, 4), (1, 4, 8), (1, 8, 8)
RTOL = 1e-5  # float32: error <= RTOL x max(1, largest reference gradient)
COST = VisionCost()


# -- workload ---------------------------------------------------------------------------------------
def make_sample(sid: int, owner: int, grids: list[tuple[int, int, int]]) -> dict:
    """Deterministic per id: text chunks around each image's placeholders, a masked 2-token prompt."""
    rng = np.random.default_rng([20240607, sid])
    ids: list[int] = []
    labels: list[int] = []
    pixels, images = [], []
    for grid in [*grids, None]:
        text = rng.integers(4, VOCAB, int(rng.integers(3, 8))).tolist()
        ids += text
        labels += text
        if grid is None:
            break
        patches = grid[0] * grid[1] * grid[2]
        ids += [IMG] * (patches // 4)
        labels += [IGNORE_INDEX] * (patches // 4)
        pixels.append(rng.standard_normal((patches, PATCH_DIM)).astype(np.float32))
        images.append((patches, patches // 4))
    labels[:2] = [IGNORE_INDEX] * 2
    payload = {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64)}
    meta = Sample(sid, len(ids), core.loss_tokens(payload["labels"]), home_rank=owner, images=tuple(images))
    return {"payload": payload, "pixels": pixels, "grids": list(grids), "sample": meta}


def make_case(name: str, world: int, groups: list[list[list[tuple]]], layout: str) -> dict:
    """groups[r] = rank r's samples, each a list of image grids. The real plan and every rank's batches."""
    samples, row, sid = {}, [], 0
    for r, group in enumerate(groups):
        row.append([])
        for grids in group:
            samples[sid] = make_sample(sid, r, grids)
            row[-1].append(samples[sid]["sample"])
            sid += 1
    exchanges = plan_vision(row, COST)
    t_tok = sum(s.loss_tokens for g in row for s in g)
    return {
        "name": name,
        "world": world,
        "row": row,
        "samples": samples,
        "exchanges": exchanges,
        "layout": layout,
        "t_tok": t_tok,
    }


def text_batch(case: dict, rank: int) -> dict[str, np.ndarray]:
    collate = core.collate_padded if case["layout"] == "padded" else core.collate_packed
    return collate([case["samples"][s.id]["payload"] for s in case["row"][rank]])


def vision_arrays(case: dict, images: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """pixel_values / image_grid_thw of these (sample id, image index) in this order (none: no keys)."""
    if not images:
        return {}
    samples = case["samples"]
    return {
        "pixel_values": np.concatenate([samples[s]["pixels"][k] for s, k in images]),
        "image_grid_thw": np.asarray([samples[s]["grids"][k] for s, k in images], np.int64),
    }


def two_phase_batch(case: dict, rank: int, exchange: Exchange) -> dict[str, np.ndarray]:
    """What batchd delivers to `rank` under two-phase balancing: its LLM text, its encoder's pixels."""
    return {
        **text_batch(case, rank),
        **vision_arrays(case, [(im.sample_id, im.index) for im in exchange.encode]),
        **exchange_arrays(exchange),
    }


def own_images(case: dict, rank: int) -> list[tuple[int, int]]:
    return [(s.id, k) for s in case["row"][rank] for k in range(len(s.images))]


def one_phase_batch(case: dict, rank: int) -> dict[str, np.ndarray]:
    """The reference's batch for `rank`: its own images, encoded in place, no exchange arrays."""
    return {**text_batch(case, rank), **vision_arrays(case, own_images(case, rank))}


def swapped(exchange: Exchange) -> dict[str, np.ndarray]:
    """The control: two received images of equal token count trade places (the arrays stay valid)."""
    arrays = exchange_arrays(exchange)
    placement, tokens = arrays["vision_placement"].copy(), arrays["vision_image_tokens"]
    for a in range(len(placement)):
        for b in range(a + 1, len(placement)):
            if tokens[placement[a]] == tokens[placement[b]]:
                placement[[a, b]] = placement[[b, a]]
                return {**arrays, "vision_placement": placement}
    raise AssertionError(f"no two images of equal size on rank {exchange.rank}")


def cases_for(world: int) -> list[dict]:
    rng = np.random.default_rng([world, 5])
    grids = (SMALL, WIDE, BIG)
    moved = [[[BIG, SMALL], [SMALL, BIG], [WIDE]]]  # rank 0: crowded, with two SMALL images
    for _ in range(1, world):
        moved.append([[grids[int(rng.integers(3))]] if rng.random() < 0.5 else [] for _ in range(2)])
    text_only = [[[], []] for _ in range(world)]
    crowded = [[[BIG, WIDE], [SMALL, BIG], [WIDE, SMALL], [BIG]]] + [[[], []] for _ in range(1, world)]
    return [
        make_case("moved", world, moved, "padded"),
        make_case("no_images", world, text_only, "padded"),
        make_case("one_rank_all", world, crowded, "packed"),
    ]


# -- model, losses, gradients ----------------------------------------------------------------------------
def make_model() -> TinyMLLM:
    torch.manual_seed(4321)
    return TinyMLLM(
        IMG,
        vocab_size=VOCAB,
        d_model=32,
        n_layers=1,
        n_heads=2,
        d_vision=16,
        n_vision_layers=1,
        n_vision_heads=2,
    )


def grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy().copy()
        for n, p in model.named_parameters()
    }


def reference(case: dict) -> tuple[float, dict[str, np.ndarray]]:
    """One process: the global per-token loss over every rank's one-phase batch, and its gradients."""
    model = make_model()
    total = sum(
        token_loss_sum(model(to_torch(one_phase_batch(case, r))), to_torch(text_batch(case, r))["labels"])[0]
        for r in range(case["world"])
    )
    loss = total / case["t_tok"]
    loss.backward()
    return float(loss.detach()), grads(model)


def ddp_step(ddp: DDP, case: dict, rank: int, batch: dict) -> tuple[float, dict[str, np.ndarray]]:
    """One DDP forward/backward with the loss scale N t_r / T_tok; returns (S_r / T_tok, grads)."""
    ddp.zero_grad(set_to_none=True)
    t_r = sum(s.loss_tokens for s in case["row"][rank])
    batch = to_torch(batch)
    logits = ddp(batch)
    loss = scaled_loss(logits, batch["labels"], loss_scale(t_r, case["t_tok"], case["world"]), t_r)
    loss.backward()
    with torch.no_grad():
        share = float(token_loss_sum(logits, batch["labels"])[0]) / case["t_tok"]
    return share, grads(ddp.module)


def tag_rows(exchange: Exchange, width: int = 5) -> torch.Tensor:
    """Encoder output whose rows say what they are: (sample id, image index, row, encoder rank, noise)."""
    rows = []
    for im in exchange.encode:
        noise = np.random.default_rng([im.sample_id, im.index]).standard_normal(im.tokens)
        for k in range(im.tokens):
            rows.append([im.sample_id, im.index, k, exchange.rank, noise[k]][:width])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, width)


def upstream(rank: int, rows: int, width: int = 5) -> np.ndarray:
    """The gradient fed into the exchange's output on `rank` (known to every process)."""
    return np.random.default_rng([99, rank]).standard_normal((rows, width)).astype(np.float32)


# -- the distributed worker -----------------------------------------------------------------------------
def run_rank(rank: int, world: int, cases: list[dict]) -> dict:
    model = make_model()
    ddp = DDP(model)
    out: dict = {}
    for case in cases:
        ex = case["exchanges"][rank]
        out[case["name"]] = ddp_step(ddp, case, rank, two_phase_batch(case, rank, ex))
    moved = cases[0]
    ex = moved["exchanges"][rank]
    control = {**two_phase_batch(moved, rank, ex), **(swapped(ex) if rank == 0 else {})}
    out["control"] = ddp_step(ddp, moved, rank, control)
    # the exchange alone, on tagged rows
    encoded = tag_rows(ex).requires_grad_(True)
    got = exchange_image_embeddings(encoded, exchange_arrays(ex))
    (got * torch.from_numpy(upstream(rank, got.shape[0]))).sum().backward()
    out["exchange"] = (got.detach().numpy(), encoded.grad.numpy())
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"world{n}")
def run(request, tmp_path_factory) -> dict:
    world = request.param
    cases = cases_for(world)
    out_dir = tmp_path_factory.mktemp(f"exchange{world}")
    t0 = time.perf_counter()
    ranks = gloo_ranks(run_rank, (world, cases), world, out_dir, SPAWN_DEADLINE_S, PG_TIMEOUT_S)
    wall = time.perf_counter() - t0
    return {"world": world, "cases": {c["name"]: c for c in cases}, "ranks": ranks, "wall_s": wall}


def max_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, float]:
    """(largest absolute gradient difference, its tolerance)."""
    assert got.keys() == want.keys()
    err = max(float(np.abs(got[n] - want[n]).max()) for n in want)
    scale = max(1.0, max(float(np.abs(w).max()) for w in want.values()))
    return err, RTOL * scale


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moved", "no_images", "one_rank_all"])
def test_two_phase_ddp_step_equals_one_process(run, name):
    case = run["cases"][name]
    want_loss, want = reference(case)
    got_loss = sum(r[name][0] for r in run["ranks"])
    assert abs(got_loss - want_loss) <= RTOL * max(1.0, abs(want_loss)), (got_loss, want_loss)
    for rank, res in enumerate(run["ranks"]):
        err, tol = max_error(res[name][1], want)
        assert err <= tol, (name, rank, err, tol)
    vision = [n for n in want if n.startswith("vision.")]
    moved_any = any(im.owner != ex.rank for ex in case["exchanges"] for im in ex.encode)
    if name == "no_images":
        assert all(ex.empty for ex in case["exchanges"]) and not any(want[n].any() for n in vision)
    else:  # images did move, and the encoder really learns from them
        assert moved_any and all(want[n].any() for n in vision)


@pytest.mark.slow
def test_control_wrong_placement_differs(run):
    """Two equal-size images swapped on rank 0: valid arrays, wrong step. The comparison catches it."""
    case = run["cases"]["moved"]
    want_loss, want = reference(case)
    got_loss = sum(r["control"][0] for r in run["ranks"])
    err, tol = max_error(run["ranks"][0]["control"][1], want)
    assert err > 100 * tol, (err, tol)
    assert abs(got_loss - want_loss) > 10 * RTOL * max(1.0, abs(want_loss)), (got_loss, want_loss)


@pytest.mark.slow
def test_plans_encode_every_image_once_and_spread_a_crowded_rank(run):
    world = run["world"]
    for case in run["cases"].values():
        every = Counter((s.id, k) for g in case["row"] for s in g for k in range(len(s.images)))
        encoded = Counter((im.sample_id, im.index) for ex in case["exchanges"] for im in ex.encode)
        assert encoded == every and set(encoded.values()) <= {1}
    crowded = run["cases"]["one_rank_all"]
    assert all(s.images == () for g in crowded["row"][1:] for s in g)
    assert all(ex.encode for ex in crowded["exchanges"]), [len(ex.encode) for ex in crowded["exchanges"]]
    loads = phase_loads(crowded["exchanges"], COST)
    total = COST.samples(crowded["row"][0])
    floor = max(total / world, max(COST.image(p) for s in crowded["row"][0] for p, _ in s.images))
    assert max(loads) <= 1.5 * floor < total, loads  # near the best possible, far below one rank doing all


@pytest.mark.slow
def test_exchange_moves_rows_and_gradients_as_a_permutation(run):
    """Forward: each owner receives exactly its LLM images, in LLM order, each from the rank that encoded
    it. Backward: each encoder gets the upstream gradient rows of the rows it sent (numpy reference)."""
    case = run["cases"]["moved"]
    exchanges = case["exchanges"]
    # where each (sample id, image index, row) lands: (owner rank, row in the owner's LLM order)
    landing = {}
    for rank, _group in enumerate(case["row"]):
        want = []
        for (sid, k), source in zip(own_images(case, rank), exchanges[rank].sources, strict=True):
            for row in range(case["samples"][sid]["sample"].images[k][1]):
                landing[(sid, k, row)] = (rank, len(want))
                want.append([sid, k, row, source])
        got, _ = run["ranks"][rank]["exchange"]
        assert got.shape == (len(want), 5)
        assert np.array_equal(got[:, :4], np.asarray(want, np.float32).reshape(-1, 4)), rank
    for rank, ex in enumerate(exchanges):
        _, grad = run["ranks"][rank]["exchange"]
        sent = tag_rows(ex).numpy()
        expected = np.zeros_like(sent)
        for i, (sid, k, row, _, _) in enumerate(sent.tolist()):
            owner, at = landing[(int(sid), int(k), int(row))]
            expected[i] = upstream(owner, len(run["ranks"][owner]["exchange"][0]))[at]
        assert np.array_equal(grad, expected), rank


# -- single-process unit tests -------------------------------------------------------------------------
def arrays(send, recv, placement, tokens) -> dict[str, np.ndarray]:
    return {
        k: np.asarray(v, np.int64)
        for k, v in zip(EXCHANGE_KEYS, (send, recv, placement, tokens), strict=True)
    }


def test_without_exchange_arrays_encoded_is_returned_as_is():
    x = torch.randn(6, 4)
    assert exchange_image_embeddings(x, {"input_ids": np.zeros((1, 3))}) is x


def test_one_rank_exchange_is_the_placement_and_its_inverse():
    """N = 1 needs no process group: received images (in encode order) go to their LLM places, and the
    gradient comes back through the inverse permutation."""
    # LLM images 0, 1, 2 of 2, 3, 1 tokens; encoded (received) in the order 2, 0, 1
    batch = arrays([6], [6], [2, 0, 1], [2, 3, 1])
    encoded = torch.arange(12, dtype=torch.float64).view(6, 2).requires_grad_(True)
    out = exchange_image_embeddings(encoded, batch)
    # received rows: image 2 -> row 0, image 0 -> rows 1-2, image 1 -> rows 3-5; LLM order 0, 1, 2
    order = [1, 2, 3, 4, 5, 0]
    assert torch.equal(out, encoded.detach()[order])
    upstream_grad = torch.randn(6, 2, dtype=torch.float64)
    out.backward(upstream_grad)
    inverse = torch.empty(6, dtype=torch.int64)
    inverse[torch.tensor(order)] = torch.arange(6)
    assert torch.equal(encoded.grad, upstream_grad[inverse])
    torch.autograd.gradcheck(
        lambda e: exchange_image_embeddings(e, batch), (encoded.detach().requires_grad_(),)
    )
    # torch tensors work as well as numpy arrays; empty works
    assert torch.equal(exchange_image_embeddings(encoded, to_torch(batch)), out)
    assert exchange_image_embeddings(torch.zeros(0, 2), arrays([0], [0], [], [])).shape == (0, 2)


@pytest.mark.parametrize(
    "encoded, batch, match",
    [
        (torch.zeros(5, 2), arrays([6], [6], [0], [6]), "encoded rows=5"),
        (torch.zeros(6), arrays([6], [6], [0], [6]), "encoded must be"),
        (torch.zeros(6, 2), arrays([6], [6], [1], [6]), "vision_placement"),
        (torch.zeros(6, 2), arrays([6], [6], [0, 0], [3, 3]), "vision_placement"),
        (torch.zeros(6, 2), arrays([6], [5], [0], [6]), "vision_recv_splits"),
        (torch.zeros(6, 2), arrays([6], [6], [0, 1], [6, 0]), "vision_image_tokens"),
        (torch.zeros(6, 2), arrays([6], [-6], [0], [6]), "vision_recv_splits"),
        (torch.zeros(6, 2), arrays([6, 0], [6, 0], [0], [6]), "initialized"),
        (torch.zeros(6, 2), arrays([6, 0], [6], [0], [6]), "one entry per rank"),
        (torch.zeros(6, 2), {**arrays([6], [6], [0], [6]), "vision_placement": np.zeros(1)}, "integer"),
        (torch.zeros(6, 2), {**arrays([6], [6], [0], [6]), "vision_image_tokens": np.asarray([[6]])}, "1-D"),
        (torch.zeros(6, 2), {"vision_send_splits": np.asarray([6])}, "lacks"),
    ],
)
def test_exchange_rejects_bad_arguments(encoded, batch, match):
    with pytest.raises(ValueError, match=match):
        exchange_image_embeddings(encoded, batch)


def test_recv_splits_must_not_cut_an_image(monkeypatch):
    """Two sources of 3 rows each cannot deliver images of 2 and 4 rows (placement 0, 1). Validation runs
    before any collective, so a faked 2-rank group is enough."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(ValueError, match="cut a received item"):
        exchange_image_embeddings(torch.zeros(3, 2), arrays([3, 0], [3, 3], [0, 1], [2, 4]))
    with pytest.raises(ValueError, match="world_size=2"):
        exchange_image_embeddings(torch.zeros(6, 2), arrays([6, 0, 0], [6, 0, 0], [0], [6]))


def test_lm_inputs_embeds_equals_ids_and_validates():
    torch.manual_seed(0)
    lm = TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2)
    ids = torch.randint(0, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    assert torch.equal(lm(ids, mask), lm(attention_mask=mask, inputs_embeds=lm.embed(ids)))
    with pytest.raises(ValueError, match="exactly one"):
        lm(ids, inputs_embeds=lm.embed(ids))
    with pytest.raises(ValueError, match="exactly one"):
        lm()
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        lm(inputs_embeds=torch.zeros(2, 7, 16))
    with pytest.raises(ValueError, match="attention_mask"):
        lm(attention_mask=mask[:, :3], inputs_embeds=lm.embed(ids))


def test_mllm_image_embedding_does_not_depend_on_its_companions():
    """Per-image attention and per-row layers: an image encodes the same alone or beside others."""
    model = make_model()
    a = make_sample(1, 0, [BIG, SMALL])
    b = make_sample(2, 0, [WIDE])
    both = model.vision(
        torch.from_numpy(np.concatenate(a["pixels"] + b["pixels"])), torch.tensor(a["grids"] + b["grids"])
    )
    alone = model.vision(torch.from_numpy(b["pixels"][0]), torch.tensor(b["grids"]))
    assert both.shape == (16 + 4 + 8, 32)
    assert torch.allclose(both[20:], alone, atol=1e-6, rtol=0)
    assert not torch.allclose(both[:4], both[20:24], atol=1e-3)  # different images, different rows


def test_mllm_forward_scatters_images_in_llm_order():
    """One-phase forward == writing each sample's own encoder rows at its placeholders by hand."""
    model = make_model()
    case = make_case("x", 1, [[[SMALL, WIDE], [], [BIG]]], "padded")
    batch = to_torch(one_phase_batch(case, 0))
    logits = model(batch)
    rows = model.encode(batch)
    tokens = model.lm.embed(batch["input_ids"]).clone()
    tokens[(batch["input_ids"] == IMG) & batch["attention_mask"].bool()] = rows
    want = model.lm(
        attention_mask=batch["attention_mask"], position_ids=batch["position_ids"], inputs_embeds=tokens
    )
    assert torch.allclose(logits, want, atol=1e-6, rtol=0)
    # packed: every sample's logits equal its padded ones
    packed = model(
        to_torch(
            {
                **core.collate_packed([case["samples"][s.id]["payload"] for s in case["row"][0]]),
                **vision_arrays(case, own_images(case, 0)),
            }
        )
    )
    lengths = [s.length for s in case["row"][0]]
    starts = np.concatenate(([0], np.cumsum(lengths)))
    for i, n in enumerate(lengths):
        assert torch.allclose(packed[0, starts[i] : starts[i] + n], logits[i, :n], atol=1e-5, rtol=0)
    # the exchange path with N = 1 and identity arrays is the one-phase path
    ex = plan_vision(case["row"], COST)[0]
    assert torch.allclose(model({**batch, **exchange_arrays(ex)}), logits, atol=0, rtol=0)


def test_mllm_validates():
    model = make_model()
    case = make_case("x", 1, [[[SMALL]]], "padded")
    batch = to_torch(one_phase_batch(case, 0))
    with pytest.raises(ValueError, match="image-token positions"):
        model(
            {
                **batch,
                **{k: v[:8] for k, v in batch.items() if k == "pixel_values"},
                "image_grid_thw": torch.tensor([[1, 2, 4]]),
            }
        )
    with pytest.raises(ValueError, match="even h, w"):
        image_patches(torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="pixel_values must be"):
        model({**batch, "pixel_values": batch["pixel_values"][:12]})
    with pytest.raises(ValueError, match="come together"):
        model({k: v for k, v in batch.items() if k != "image_grid_thw"})
    for bad in (0, VOCAB, True):
        with pytest.raises(ValueError, match="image_token_id"):
            TinyMLLM(bad, vocab_size=VOCAB)


def test_mllm_init_is_deterministic_and_every_parameter_learns():
    m1, m2 = make_model(), make_model()
    assert all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True)
    )
    assert TinyMLLM(IMG).num_parameters() == 690_624  # the module docstring's count
    case = make_case("x", 1, [[[SMALL, BIG], [WIDE]]], "padded")
    batch = to_torch(one_phase_batch(case, 0))
    token_loss_sum(m1(batch), batch["labels"])[0].backward()
    assert all(p.grad is not None and p.grad.any() for p in m1.parameters())
    # no image at all: the encoder still runs on zero rows, so each parameter has a (zero) gradient
    m2.zero_grad()
    text = to_torch(text_batch(make_case("y", 1, [[[], []]], "padded"), 0))
    token_loss_sum(m2(text), text["labels"])[0].backward()
    assert all(p.grad is not None for p in m2.parameters())
    assert not any(p.grad.any() for p in m2.vision.parameters())
