import importlib.util


def test_packages_import():
    import http_scorer
    import omni_async

    assert omni_async.__name__ == "omni_async" and http_scorer.__name__ == "http_scorer"


def test_torchvision_absent():
    # torchvision breaks transformers' image processors on this torch; the lock must never pull it in.
    assert importlib.util.find_spec("torchvision") is None


def test_config_ships_with_package():
    from omni_async.trainer.config import CONFIG_DIR

    assert (CONFIG_DIR / "flowgrpo_trainer.yaml").is_file()
