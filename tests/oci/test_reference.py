"""Docker's reference rules, table-driven from distribution/reference's own test cases
(normalize_test.go, reference_test.go) and Docker's documented behaviour."""

from __future__ import annotations

import pytest

from ephemeral import errors
from ephemeral.oci.reference import parse

D = "sha256:" + "ab" * 32

# text -> (domain, path, tag, digest)
VALID = {
    "ubuntu": ("docker.io", "library/ubuntu", "latest", None),
    "ubuntu:24.04": ("docker.io", "library/ubuntu", "24.04", None),
    "python:3.13-slim-bookworm": ("docker.io", "library/python", "3.13-slim-bookworm", None),
    "docker.io/ubuntu": ("docker.io", "library/ubuntu", "latest", None),
    "index.docker.io/library/debian": ("docker.io", "library/debian", "latest", None),
    "index.docker.io/docker/docker": ("docker.io", "docker/docker", "latest", None),
    "docker.io/library/foo/bar": ("docker.io", "library/foo/bar", "latest", None),
    "library/foo/bar": ("docker.io", "library/foo/bar", "latest", None),
    "swebench/sweb.eval.x86_64.astropy__astropy-12907": (
        "docker.io",
        "swebench/sweb.eval.x86_64.astropy__astropy-12907",
        "latest",
        None,
    ),
    "test_com/foo": ("docker.io", "test_com/foo", "latest", None),
    "test.com/foo": ("test.com", "foo", "latest", None),
    "test-com:8080/foo": ("test-com:8080", "foo", "latest", None),
    "xn--n3h.com:18080/foo": ("xn--n3h.com:18080", "foo", "latest", None),
    "ghcr.io/org/img:tag": ("ghcr.io", "org/img", "tag", None),
    "localhost/foo": ("localhost", "foo", "latest", None),
    "localhost:5000/a/b:c": ("localhost:5000", "a/b", "c", None),
    "127.0.0.1:5000/private/moonbase": ("127.0.0.1:5000", "private/moonbase", "latest", None),
    f"127.0.0.1:5000/repo@{D}": ("127.0.0.1:5000", "repo", None, D),
    "[fc00::1]:5000/docker/docker": ("[fc00::1]:5000", "docker/docker", "latest", None),
    # an uppercase first element is a domain: a path never is uppercase
    "Foo/bar": ("Foo", "bar", "latest", None),
    "FOO/bar": ("FOO", "bar", "latest", None),
    # tag and digest together: both kept, the digest is what is pulled
    f"busybox:latest@{D}": ("docker.io", "library/busybox", "latest", D),
    f"redis@{D}": ("docker.io", "library/redis", None, D),
    # no '/': never a domain (Docker's FIXME): a tag of docker.io/library/192.168.0.1
    "192.168.0.1:80": ("docker.io", "library/192.168.0.1", "80", None),
    "docker---rules/docker": ("docker.io", "docker---rules/docker", "latest", None),
    "dock__er/docker": ("docker.io", "dock__er/docker", "latest", None),
    "d/docker": ("docker.io", "d/docker", "latest", None),
    # a 64-character name that is not all hex is a name
    "thisisthesongthatneverendsitgoesonandonandonthisisthesongthatnev": (
        "docker.io",
        "library/thisisthesongthatneverendsitgoesonandonandonthisisthesongthatnev",
        "latest",
        None,
    ),
    "docker.io/" + "1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a": (
        "docker.io",
        "library/1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a",
        "latest",
        None,
    ),
}

INVALID = [
    "",
    "https://github.com/docker/docker",
    "docker/Docker",
    "docker.io/docker/Docker",
    "-docker",
    "-docker/docker",
    "docker-/docker",
    "-docker.io/docker/docker",
    "docker///docker",
    "docker.io/docker///docker",
    "[fc00::1]",
    "[fc00::1]:5000",
    "fc00::1:5000/debian",
    "[fe80::1%eth0]:5000/debian",
    "1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a",
    "____/____",
    "_docker/_docker",
    "dock..er/docker",
    "dock_.er/docker",
    "dock-.er/docker",
    "docker/",
    "ubuntu:",
    "ubuntu:-tag",
    "ubuntu:" + "t" * 129,
    "ubuntu@sha256:abc",  # too short
    "ubuntu@sha256:" + "AB" * 32,  # go-digest wants lowercase hex
    "ubuntu@md5:" + "ab" * 16,  # an algorithm nothing verifies
    "a/" * 127 + "b",  # longer than 255
    "ubuntu:tag with space",
]


@pytest.mark.parametrize("text", sorted(VALID))
def test_valid_references_normalize_as_docker_does(text: str) -> None:
    ref = parse(text)
    assert (ref.domain, ref.path, ref.tag, ref.digest) == VALID[text]


@pytest.mark.parametrize("text", INVALID)
def test_invalid_references_are_a_422_naming_the_field(text: str) -> None:
    with pytest.raises(errors.InvalidRequest) as exc:
        parse(text, field="image")
    assert exc.value.errors is not None
    assert [e["field"] for e in exc.value.errors] == ["image"]
    assert "is not an image reference" in exc.value.detail


def test_string_forms() -> None:
    ref = parse("ubuntu:24.04")
    assert str(ref) == "docker.io/library/ubuntu:24.04"
    assert ref.familiar() == "ubuntu:24.04"
    assert ref.target == "24.04"
    pinned = parse(f"busybox:latest@{D}")
    assert str(pinned) == f"docker.io/library/busybox:latest@{D}"
    assert pinned.familiar() == f"busybox:latest@{D}"
    assert pinned.target == D  # the digest wins over the tag
    assert parse("library/foo/bar").familiar() == "library/foo/bar:latest"
    assert parse("ghcr.io/org/img").familiar() == "ghcr.io/org/img:latest"
