"""A rank's place without Ray: rank_and_world's sources, in order, and the one-rank exchange."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")


def test_rank_and_world_arguments_win_then_the_environment_then_rank_0_of_1(monkeypatch):
    from stoker.cluster.train.rankdata import rank_and_world

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_and_world() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world() == (2, 4)
    assert rank_and_world(1) == (1, 4)
    assert rank_and_world(0, 2) == (0, 2)
    with pytest.raises(ValueError, match="rank=5, world_size=4"):
        rank_and_world(5)


def test_one_rank_gathers_its_own_value_without_any_group_or_actor():
    from stoker.cluster.train.allgather import Exchange

    ex = Exchange(0, 1, "solo")
    assert ex.all_gather("node-a") == ["node-a"]
    assert ex.all_gather({"members": ["node-a"]}, last=True) == [{"members": ["node-a"]}]


def test_the_board_answers_once_every_rank_posted_and_refuses_another_world_size():
    from stoker.cluster.train.allgather import _Board

    board = _Board(2)
    board.post(1, 1, "b", 2)
    assert board.take(1, 1) == (None, False) and board.missing(1) == [0]
    board.post(1, 0, "a", 2)
    assert board.take(1, 0) == (["a", "b"], False)
    assert board.take(1, 1) == (["a", "b"], True)  # every rank has read the round
    with pytest.raises(ValueError, match="3 ranks, the board was made for 2"):
        board.post(2, 0, "x", 3)
