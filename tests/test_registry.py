import pytest

from beamrl.registry import Registry, RegistryError


def test_register_get_names_and_errors():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    reg.register("a")(len)
    assert reg.get("b") is b and reg.names() == ["a", "b"] and "a" in reg and len(reg) == 2
    with pytest.raises(RegistryError, match=r"unknown widget 'c'; allowed: a, b"):
        reg.get("c")
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a")(max)
    reg.register("a")(len)  # re-registering the same object (module re-import) is fine
    with pytest.raises(RegistryError, match="non-empty"):
        reg.register("")
