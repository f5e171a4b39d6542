"""A request's own chat template is compiled for its render and kept nowhere after it.

With ``--trust_request_chat_template`` a client sends the template text.  Jinja folds constant
expressions when it compiles (``{{ 'x' * 2000000 }}`` becomes one 2 MB string in the compiled code),
and every cache keyed by template text keeps its key and value after the request: transformers'
``_compile_jinja_template`` (an LRU of 128 compiled templates) and this server's parse-result caches
(``developer_role``, ``chat_content_format``, ``template_variables``).  Six requests each with its
own such template raised the HTTP process by 300 MB that stayed after their 400s.

The server's templates (the checkpoint's, ``--chat_template``'s) are one per server and stay cached.
A request's template is compiled afresh for each render inside :func:`request_template_render`
(transformers' own uncompiled builder, the ``__wrapped__`` of its LRU, so the prompt is
byte-identical), and the server's parse-result caches are bypassed for it by their callers.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

_state = threading.local()


def rendering_request_template() -> bool:
    """True inside :func:`request_template_render` on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def request_template_render() -> Iterator[None]:
    """While it is open, transformers compiles chat templates on this thread without its cache
    (renders are synchronous, on the calling thread: the tokenizer threads render one chat each);
    when it closes, the templates compiled meanwhile are released at once (:func:`_release`)."""
    _install_once()
    if not hasattr(_state, "compiled"):
        _state.compiled = []
    _state.depth = getattr(_state, "depth", 0) + 1
    mark = len(_state.compiled)
    try:
        yield
    finally:
        _state.depth -= 1
        compiled, _state.compiled[mark:] = _state.compiled[mark:], []
        for template in compiled:
            _release(template)


def _release(template: Any) -> None:
    """Break the reference cycle of a compiled Jinja template, so its code (and the constants folded
    into it) is freed as soon as the render drops it, not at some later full garbage collection: the
    module namespace its render functions run in holds the template (``__jinja_template__``) and the
    functions themselves.  The template is not rendered again after this."""
    render = getattr(template, "root_render_func", None)
    namespace = getattr(render, "__globals__", None)
    if isinstance(namespace, dict):
        namespace.clear()


def cached_unless_request(function: Callable[[str], Any], maxsize: int) -> Callable[..., Any]:
    """``function`` behind an LRU of ``maxsize`` for the server's templates; called directly for a
    request's own (``request_template=True``), so nothing of it is kept.  The LRU is ``.cache``."""
    cache = functools.lru_cache(maxsize=maxsize)(function)

    @functools.wraps(function)
    def lookup(template: Any, request_template: bool = False) -> Any:
        return function(template) if request_template else cache(template)

    lookup.cache = cache  # type: ignore[attr-defined]
    return lookup


def _install() -> bool:
    """Route transformers' chat-template compilation through :func:`_compile`; False when this
    transformers has no LRU there (nothing to bypass)."""
    try:
        from transformers.utils import chat_template_utils
    except ImportError:
        return False
    current = getattr(chat_template_utils, "_compile_jinja_template", None)
    if getattr(current, "_lightllm_request_bypass", False):
        return True
    uncached = getattr(current, "__wrapped__", None)
    if current is None or uncached is None or not hasattr(current, "cache_info"):
        return False

    def _compile(chat_template: str) -> Any:
        if rendering_request_template():
            template = uncached(chat_template)
            _state.compiled.append(template)
            return template
        return current(chat_template)

    # Not functools.wraps: its __wrapped__ would be the cached function.
    _compile.__name__, _compile.__qualname__, _compile.__doc__ = current.__name__, current.__qualname__, current.__doc__
    _compile.__wrapped__ = uncached  # type: ignore[attr-defined]
    _compile.cache_info = current.cache_info  # type: ignore[attr-defined]
    _compile.cache_clear = current.cache_clear  # type: ignore[attr-defined]
    _compile._lightllm_request_bypass = True  # type: ignore[attr-defined]
    chat_template_utils._compile_jinja_template = _compile
    return True


@functools.lru_cache(maxsize=1)
def _install_once() -> bool:
    """:func:`_install` on the first request-template render, not at import: the HTTP process's entry
    modules import no transformers (``test_torch_free_processes``); the tokenizer loads it later.
    (Two first renders at once may both run :func:`_install`, which is idempotent.)"""
    return _install()
