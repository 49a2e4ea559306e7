"""The contract between the trainer and reward functions, as verl / verl-omni define it.

- **Images and video.** A reward function gets ``solution_image`` as verl-omni's ``VisualRewardManager`` hands it
  over: a uint8 ``torch.Tensor`` in [0, 255], shape ``(C, H, W)`` for an image and ``(C, F, H, W)`` for a video
  (``C`` = 3, RGB), the layout every verl-omni video reward reads (``genrm_ocr`` and ``hpsv3_reward`` take a 4-D
  tensor whose last axis is not 1 or 3 as ``[C, F, H, W]``; ``reward_utils.video_tensor_to_pil_frames`` takes it
  too). The trainer's own pixels are numpy ``(H, W, 3)`` / ``(F, H, W, 3)``;
  :func:`~omni_async.reward.pixels.to_solution_image` is the one conversion, at the call site. Text gets
  ``solution_str`` as in verl.
- **Arguments.** The single reward (``reward.custom_reward_function``) is called with all of ``data_source``,
  ``solution_image`` | ``solution_str``, ``ground_truth``, ``extra_info`` and its ``reward_kwargs``, as verl-omni's
  ``VisualRewardManager`` calls it. Each of several rewards (``reward.reward_functions.<key>``, verl-omni's
  ``MultiVisualRewardManager``) gets only the arguments its signature declares, all of them if it takes
  ``**kwargs`` (:func:`declared_arguments`): verl-omni's ``jpeg_compressibility.compute_score(solution_image)``
  runs there unchanged.
- **The project's scorers accept every form**: the tensor above, the numpy ``(H, W, 3)`` / ``(F, H, W, 3)``
  array, a PIL image, or a list of frames. :func:`~omni_async.reward.pixels.to_pixels` is the single way back to
  numpy; a torch tensor is always read as channels-first and a numpy array as channels-last (by type, never guessed
  from the shape).
- **No ``custom_reward_function.path``**: :func:`default_compute_score` dispatches on ``data_source`` as verl
  (text: ``verl.utils.reward_score.default_compute_score``) and verl-omni (images:
  ``default_compute_score_image``) do.
- **At start, on the driver**: :func:`check_reward_function` loads each configured function with verl's
  ``load_extern_object`` path forms and fails with the config key, the path and the names that do exist,
  instead of ~35 s later inside a Ray actor.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from typing import Any

PKG_PREFIX, FILE_PREFIX = "pkg://", "file://"  # verl.utils.import_utils.load_module's path forms

# data_source -> (scorer, what it is). "jpeg_compressibility" is verl-omni's default image reward; "flow_grpo/ocr"
# is what verl-omni's OCR data scripts write, "ocr" what examples/data/prepare_ocr_prompts.py writes.
IMAGE_DATA_SOURCES = {
    "ocr": "OCR similarity (omni_async.reward.scorers.ocr)",
    "flow_grpo/ocr": "OCR similarity (omni_async.reward.scorers.ocr)",
    "jpeg_compressibility": "JPEG compressibility, -kB/500 as verl-omni / DDPO (omni_async.reward.scorers.jpeg)",
}
VERL_TEXT_EXAMPLES = "openai/gsm8k, lighteval/MATH, HuggingFaceH4/MATH-500, math_dapo, aime*, hiyouga/geometry3k"
FIX = (
    "set reward.custom_reward_function.path (a file or pkg://module) and reward.custom_reward_function.name "
    "to your compute_score, or use one of these data sources"
)


class UnknownDataSourceError(NotImplementedError):
    """No default reward for this ``data_source`` (verl raises NotImplementedError too)."""


class RewardConfigError(ValueError):
    """A configured reward function that cannot be loaded; the message names the config key."""


# ------------------------------------------------------------------------------------- data_source dispatch


def default_compute_score(
    data_source: str,
    solution_str: str | None = None,
    solution_image: Any = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> Any:
    """The reward when no ``custom_reward_function.path`` is set: dispatch on ``data_source``, as verl does.

    - image data sources (``IMAGE_DATA_SOURCES``): ``ocr`` / ``flow_grpo/ocr`` -> OCR similarity with the ground
      truth (``{"score", "ocr_text"}``; ``kwargs`` go to :func:`omni_async.reward.scorers.ocr.compute_score`);
      ``jpeg_compressibility`` -> ``-kB / 500`` of the JPEG (quality 95), verl-omni's default image reward
      (a video scores the mean over its frames, where verl-omni takes the first frame);
    - text (``solution_str``): ``verl.utils.reward_score.default_compute_score`` (gsm8k, MATH, DAPO, ...);
    - anything else: :class:`UnknownDataSourceError` naming the data source, the known ones and the fix.
    """
    if solution_image is not None:
        if data_source in ("ocr", "flow_grpo/ocr"):
            from omni_async.reward.scorers import ocr

            return ocr.compute_score(data_source, solution_image, ground_truth, extra_info, **kwargs)
        if data_source == "jpeg_compressibility":
            from omni_async.reward.scorers import jpeg

            return jpeg.compute_score(data_source, solution_image, ground_truth, extra_info, **kwargs) / 500.0
        raise UnknownDataSourceError(
            f"no default image reward for data_source={data_source!r}; image data sources: "
            f"{', '.join(IMAGE_DATA_SOURCES)}. {FIX}"
        )
    if data_source in IMAGE_DATA_SOURCES:
        raise UnknownDataSourceError(
            f"data_source={data_source!r} is an image reward, but this sample is text "
            "(solution_str); set reward.custom_reward_function.path to a text reward"
        )
    from verl.utils import reward_score

    try:
        return reward_score.default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    except NotImplementedError as e:
        if repr(data_source) not in str(e):  # raised inside a known scorer: not ours to rephrase
            raise
        raise UnknownDataSourceError(
            f"no default reward for data_source={data_source!r}: verl.utils.reward_score.default_compute_score "
            f"knows text data sources such as {VERL_TEXT_EXAMPLES}; image data sources: "
            f"{', '.join(IMAGE_DATA_SOURCES)}. {FIX}"
        ) from None


# ----------------------------------------------------------------------------------- start-up config check


def _load_module(path: str, key: str):
    """verl's ``load_module`` path forms, with errors that name ``key`` and say what to do."""
    where = f"{key}.path={path!r}"
    if path.startswith(PKG_PREFIX):
        module_name = path[len(PKG_PREFIX) :].replace("/", ".")
        if module_name.endswith(".py"):
            raise RewardConfigError(
                f"{where}: pkg:// takes a dotted module name, not a file; use "
                f"pkg://{module_name[:-3]} or the file path without pkg://"
            )
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing and (module_name == missing or module_name.startswith(missing + ".")):
                raise RewardConfigError(
                    f"{where}: no module {module_name!r} importable by {sys.executable} (module {missing!r} not "
                    f"found). Fix: install the package, add its directory to PYTHONPATH, or give a file path"
                ) from None
            raise RewardConfigError(
                f"{where}: module {module_name!r} exists but importing it failed: {e} "
                f"(a dependency of the reward module; install it)"
            ) from e
        except Exception as e:
            raise RewardConfigError(f"{where}: importing module {module_name!r} failed: {type(e).__name__}: {e}") from e
    file_path = path[len(FILE_PREFIX) :] if path.startswith(FILE_PREFIX) else path
    if not os.path.isfile(file_path):
        what = "is a directory, not a .py file" if os.path.isdir(file_path) else "file not found"
        raise RewardConfigError(
            f"{where}: {what} (resolved to {os.path.abspath(file_path)!r}; relative paths are from the working "
            f"directory {os.getcwd()!r}). Fix: give the path of a .py file or pkg://dotted.module.name"
        )
    from verl.utils.import_utils import load_module

    try:
        return load_module(file_path)
    except Exception as e:
        cause = e.__cause__ or e
        raise RewardConfigError(f"{where}: loading the file failed: {type(cause).__name__}: {cause}") from e


def public_callables(module: Any) -> list[str]:
    """The public functions / classes a module defines (or, if it defines none, the ones it exposes)."""
    names = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)]
    own = [n for n in names if getattr(vars(module)[n], "__module__", None) == module.__name__]
    return sorted(own or names)


def declared_arguments(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of ``kwargs`` that ``fn`` declares: all of them if it takes ``**kwargs`` (or its signature cannot be
    read), else those named by its parameters. verl-omni's ``MultiVisualRewardManager`` calls each of several reward
    functions this way, so a function may declare only what it reads (``compute_score(solution_image)``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _bind_check(
    fn: Any, kwargs: dict[str, Any], what: str, key: str, skip_self: bool = False, only_declared: bool = False
) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins etc.: cannot tell, let the call decide
    if only_declared:
        kwargs = declared_arguments(fn, kwargs)
    try:
        if skip_self:
            sig.bind(None, **kwargs)
        else:
            sig.bind(**kwargs)
    except TypeError as e:
        raise RewardConfigError(
            f"{key}: {what}{sig} cannot be called with {sorted(kwargs)}: {e}; "
            + (
                "each of reward.reward_functions gets the arguments it declares among data_source, solution_image | "
                "solution_str, ground_truth, extra_info and its entry's extra fields; give the missing ones a default "
                "or set them in the entry"
                if only_declared
                else "reward functions are called as compute_score(data_source=..., solution_image=... | "
                "solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs); add **kwargs to accept the rest"
            )
        ) from None


def check_reward_function(
    path: str | None,
    name: str | None,
    key: str = "reward.custom_reward_function",
    reward_kwargs: dict[str, Any] | None = None,
    modality: str | None = None,
    only_declared: bool = False,
) -> Any:
    """Load a configured reward function on the driver, at start; return it, or raise :class:`RewardConfigError`.

    ``key`` is the config node (``reward.custom_reward_function`` or ``reward.reward_functions.<k>``; a trailing
    ``.path`` / ``.name`` is ignored). ``path`` takes verl's ``load_extern_object`` forms: ``pkg://a.b.c`` (or
    ``pkg://a/b/c``), ``file://x.py`` or a plain (absolute or working-directory-relative) file path. The object
    ``name`` must be a callable, or a class with a callable ``compute_score`` (built once per reward worker with
    ``reward_kwargs``). Errors name ``<key>.path`` / ``<key>.name``, the path, and the public callables that the
    module does define (with close matches). An empty ``path`` returns :func:`default_compute_score` (dispatch by
    ``data_source``, as verl does with no ``custom_reward_function.path``).

    With ``modality`` (``"image"`` or ``"text"``) the signature is checked too: the call the reward manager will
    make (``data_source``, ``solution_image`` or ``solution_str``, ``ground_truth``, ``extra_info`` and the
    ``reward_kwargs``) must bind; with ``only_declared`` (an entry of ``reward.reward_functions``) the call passes only
    what the function declares (:func:`declared_arguments`), so it must only have no required parameter left unset.
    Note that a file path's module is executed here, on the driver, as well.
    """
    for suffix in (".path", ".name"):
        key = key[: -len(suffix)] if key.endswith(suffix) else key
    if not path:
        return default_compute_score
    if not name:
        raise RewardConfigError(
            f"{key}.name is empty; name the function (or class) to call in {path!r}, e.g. compute_score"
        )
    module = _load_module(str(path), key)
    defined = public_callables(module)
    if not hasattr(module, name):
        close = difflib.get_close_matches(name, defined, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise RewardConfigError(
            f"{key}.name={name!r}: {path!r} has no attribute {name!r}; its public callables: "
            f"{', '.join(defined) or '(none)'}{hint}"
        )
    obj = getattr(module, name)
    data_kw = None
    if modality is not None:
        data_kw = {
            "data_source": "",
            "ground_truth": None,
            "extra_info": {},
            ("solution_str" if modality == "text" else "solution_image"): None,
        }
    if inspect.isclass(obj):
        if not callable(getattr(obj, "compute_score", None)):
            raise RewardConfigError(
                f"{key}.name={name!r}: class {name} in {path!r} has no compute_score method; a "
                "class reward is built once and its compute_score(data_source, ...) is called"
            )
        if data_kw is not None:
            _bind_check(obj, dict(reward_kwargs or {}), f"class {name}", key)
            method = inspect.getattr_static(obj, "compute_score")
            if isinstance(method, staticmethod):
                _bind_check(obj.compute_score, data_kw, f"{name}.compute_score", key, only_declared=only_declared)
            else:
                _bind_check(
                    obj.compute_score,
                    data_kw,
                    f"{name}.compute_score",
                    key,
                    skip_self=not isinstance(method, classmethod),
                    only_declared=only_declared,
                )
        return obj
    if not callable(obj):
        raise RewardConfigError(
            f"{key}.name={name!r}: {name} in {path!r} is a {type(obj).__name__}, not a function; "
            f"its public callables: {', '.join(defined) or '(none)'}"
        )
    if data_kw is not None:
        _bind_check(obj, {**data_kw, **(reward_kwargs or {})}, name, key, only_declared=only_declared)
    return obj
