"""Subject names: layout, namespace, validation, and wildcard matching of the in-memory bus."""

from __future__ import annotations

import pytest

from shoal.bus.subjects import SubjectError, Subjects, tokens_match, validate_subject


def test_subjects_follow_namespace_version_role_id_verb():
    s = Subjects()
    assert s.engine_in("e0") == "shoal.v1.engine.e0.in"
    assert s.engine_out("client-1") == "shoal.v1.client.client-1.out"
    assert s.engine_stats("e0") == "shoal.v1.engine.e0.stats"
    assert s.engine_stats() == "shoal.v1.engine.*.stats"
    assert s.engine_results("e0") == "shoal.v1.engine.e0.results"
    assert s.worker_in("w_3") == "shoal.v1.worker.w_3.in"
    assert s.heartbeat("worker") == "shoal.v1.control.worker.heartbeat"
    assert s.heartbeat() == "shoal.v1.control.*.heartbeat"
    assert s.status("engine") == "shoal.v1.control.engine.status"
    assert s.control("engine", "e0") == "shoal.v1.engine.e0.control"
    assert s.api_generate() == "shoal.v1.api.generate"
    assert s.api_queue() == "shoal-api"


def test_two_namespaces_never_share_a_subject():
    a, b = Subjects("prod"), Subjects("staging.shoal")
    assert a.engine_in("e0") != b.engine_in("e0")
    assert b.engine_in("e0") == "staging.shoal.v1.engine.e0.in"
    assert b.api_queue() == "staging-shoal-api"
    assert not tokens_match(tuple(a.all().split(".")), tuple(b.engine_in("e0").split(".")))
    assert tokens_match(tuple(b.all().split(".")), tuple(b.engine_in("e0").split(".")))


@pytest.mark.parametrize("bad", ["", "a.b", "*", ">", "a b", "é", "x\n"])
def test_bad_ids_are_rejected(bad: str):
    with pytest.raises(SubjectError):
        Subjects().engine_in(bad)


@pytest.mark.parametrize("bad", ["", "a.", "a b"])
def test_bad_namespaces_are_rejected(bad: str):
    with pytest.raises(SubjectError):
        Subjects(bad)


def test_wildcard_ids_only_where_allowed():
    with pytest.raises(SubjectError):
        Subjects().engine_in("*")
    with pytest.raises(SubjectError):
        Subjects().engine_stats(">")


def test_validate_subject():
    assert validate_subject("a.b-c.d_e") == "a.b-c.d_e"
    assert validate_subject("a.*.>", wildcards=True)
    for bad in ("a.*", "a.>", "a..b", ".a", "a.", "a\tb"):
        with pytest.raises(SubjectError):
            validate_subject(bad)
    with pytest.raises(SubjectError):
        validate_subject("a.>.b", wildcards=True)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("*.b.>", "x.b.y", True),
        ("*.b.>", "x.c.y", False),
        (">", "anything.at.all", True),
    ],
)
def test_subject_matching(pattern: str, subject: str, expected: bool):
    assert tokens_match(tuple(pattern.split(".")), tuple(subject.split("."))) is expected
