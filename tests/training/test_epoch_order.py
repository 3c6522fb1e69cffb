"""The head's training order (eagle_train.epoch_order): shuffled per epoch and seeded, and with
`group_by_length` batches of similar length that pad little, every batch whole."""

import random

from viasd_core.training.eagle_train import epoch_order, padded_positions

N, BATCH = 1003, 8
_rng = random.Random(7)
LENGTHS = [_rng.choice([40, 90, 250, 480]) + _rng.randrange(30) for _ in range(N)]


def test_plain_order_is_the_seeded_shuffle_it_always_was():
    expected = list(range(N))
    random.Random(3 * 100_003 + 2).shuffle(expected)
    assert epoch_order(N, BATCH, seed=3, epoch=2) == expected
    assert epoch_order(N, BATCH, seed=3, epoch=2, lengths=LENGTHS, group=0) == expected


def test_grouped_batches_are_whole_distinct_seeded_and_pad_little():
    orders = [epoch_order(N, BATCH, seed=0, epoch=e, lengths=LENGTHS, group=50) for e in range(3)]
    real = sum(LENGTHS)
    for order in orders:
        assert len(order) == N - N % BATCH and len(set(order)) == len(order) and set(order) <= set(range(N))
        batches = [order[b : b + BATCH] for b in range(0, len(order), BATCH)]
        # each batch is cut from a run sorted by length: nearly all lie within one of the four
        # length clusters (30 wide), the rest straddle two neighbours
        spans = [max(LENGTHS[i] for i in b) - min(LENGTHS[i] for i in b) for b in batches]
        assert sum(s < 30 for s in spans) > 0.85 * len(batches), spans
    assert orders[0] == epoch_order(N, BATCH, seed=0, epoch=0, lengths=LENGTHS, group=50)  # a resumed run's order
    assert orders[0] != orders[1]
    # the batches' places are shuffled, not sorted longest first
    first = [max(LENGTHS[i] for i in orders[0][b : b + BATCH]) for b in range(0, 80, BATCH)]
    assert first != sorted(first, reverse=True)
    grouped = padded_positions(orders[0], BATCH, LENGTHS) / real
    plain = padded_positions(epoch_order(N, BATCH, seed=0, epoch=0), BATCH, LENGTHS) / real
    # a batch of 8 random draws pads to its longest (close to the widest length here); grouped runs barely pad
    assert grouped < 1.05 and plain > 1.5, (grouped, plain)
    # all records take part over epochs: each epoch leaves out at most batch - 1 of them
    seen = set().union(*orders)
    assert len(seen) > N - 3 * BATCH


def test_fewer_records_than_a_batch_fall_back_to_the_plain_shuffle():
    assert sorted(epoch_order(5, BATCH, seed=0, epoch=0, lengths=[1, 2, 3, 4, 5], group=50)) == [0, 1, 2, 3, 4]
