"""Command-line parsers whose usage errors are one line, for every tool of the project.

argparse prints the whole usage block (dozens of flags) before its message; the server's and the
tools' refusals are one line naming the flag, so an operator scanning a log or a terminal finds
the message without reading the usage.  ``--help`` still prints everything.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any, Dict, Iterator, List, Mapping, NoReturn, Optional, Sequence, Tuple


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: ``error: <argparse's message>``.

    Subclasses add hints (for example what to use instead of an unknown flag) with :meth:`hints`.
    A shortened flag (``--profil``) is refused like any unknown one: argparse would guess it from
    its prefix, and a guess that runs a minute of work is not what the user typed.  A flag typed
    twice is refused too (:func:`refuse_repeated_flags`), unless it is repeatable by design
    (``action="append"``, ``"count"``, ``"extend"``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        matcher = getattr(self, "_negative_number_matcher", None)
        if matcher is not None:
            # argparse reads "-inf" / "-nan" as a flag ("expected one argument"); as values they get
            # the flag's own refusal (finite_float: "must be a finite number").
            self._negative_number_matcher = re.compile(rf"{matcher.pattern}|^-(inf|infinity|nan)$", re.IGNORECASE)

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None) -> Tuple[argparse.Namespace, List[str]]:
        """argparse's parse, then the repeated-flag refusal on what was typed."""
        parsed = super().parse_known_args(args, namespace)
        refuse_repeated_flags(self, sys.argv[1:] if args is None else list(args))
        return parsed

    def hints(self, message: str) -> List[str]:
        """Extra remarks for ``message``, put in parentheses after it (none here)."""
        return []

    def error(self, message: str) -> NoReturn:
        """Print ``error: message`` on one line and exit 2, as argparse's usage errors do.

        The words argparse lists as unrecognized are printed as flag names only
        (:func:`without_values`): a misspelled key flag's value is the key itself.
        """
        hints = self.hints(message)
        why = f" ({'; '.join(hints)})" if hints else ""
        self.exit(2, f"error: {without_values(' '.join(message.split()))}{why} (--help lists the flags)\n")


_UNRECOGNIZED = re.compile(r"^(.*unrecognized arguments: )(.*)$")
# What a flag's name looks like: lower case, as every flag of this project and of vLLM is (-h is
# argparse's).  A key that starts with "-" almost always has upper case or digits in its first
# letters, so it is not taken for a flag.
_FLAG_NAME = re.compile(r"^(--[a-z][a-z0-9_-]*|-[a-z])$")
# Flags whose value is a secret (--api-key, --admin_api_key, --hf-token, ...): the word after one
# is never shown, whatever it looks like.  By the name's last word, so --skip-tokenizer-init or
# --return-tokens-as-token-ids are not taken for one.
_SECRET_FLAG = re.compile(r"[-_](key|keys|token|tokens|secret|password)$|^--(key|token|secret|password)$")


def without_values(message: str) -> str:
    """argparse's ``unrecognized arguments: ...`` message with only the flags' names in it.

    ``--api-key supersecret`` (vLLM's spelling of ``--api_key``), ``--api_ke=secret`` or
    ``--admin-api-key secret`` would otherwise print the key on the terminal and in the logs
    that capture it; any word not starting with ``-`` may be such a value, so each is left out
    and only counted.  Other messages are returned unchanged.
    """
    match = _UNRECOGNIZED.match(message)
    if match is None:
        return message
    flags, values = [], 0
    after_secret_flag = False
    for word in match.group(2).split():
        name, _, value = word.partition("=")
        # A key may itself start with "-" (token_urlsafe's alphabet has it), so only a word shaped
        # like a flag name counts as one, and never the word after a flag named for a secret.
        if not after_secret_flag and _FLAG_NAME.match(name):
            flags.append(name)
            values += 1 if value else 0
            after_secret_flag = not value and _SECRET_FLAG.search(name) is not None
        else:
            values += 1
            after_secret_flag = False
    counted = f"{values} value{'s' if values != 1 else ''}"
    named = " ".join(flags)
    if not values:
        return f"{match.group(1)}{named}"
    if named:
        return f"{match.group(1)}{named} (and {counted}, not shown: one may be a key)"
    return f"{match.group(1)}{counted} (not shown: one may be a key)"


# Actions whose flag collects every occurrence: typing it again adds, it does not replace.
_REPEATABLE_ACTIONS = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                       argparse._ExtendAction)


def finite_float(text: str) -> float:
    """argparse type of every float flag: nan and inf would pass range checks written as comparisons."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def refuse_repeated_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Exit (``parser.error``, one line) when ``argv`` types one of ``parser``'s options twice.

    argparse keeps the last value of a flag given twice and drops the first without a word
    (``--modes normal --modes 1p1d`` ran 1p1d only); a list flag takes all its values at once.
    Both spellings of an option count as the same flag; an option repeatable by design
    (``action="append"``, ``"count"``, ``"extend"``) may be typed again.  Every
    :class:`OneLineErrorParser` calls it after its parse (``parse_args`` succeeded, as for
    :func:`given_flags`).
    """
    repeatable = {action.dest for action in parser._actions if isinstance(action, _REPEATABLE_ACTIONS)}
    seen: Dict[str, str] = {}
    for dest, option in _typed_options(parser, argv):
        if dest in repeatable:
            continue
        if dest in seen:
            also = "" if option == seen[dest] else f" (also as {option})"
            parser.error(f"{seen[dest]} is given twice{also}; give it once, with all its values")
        seen[dest] = option


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Dict[str, str]:
    """``dest -> flag`` of every option of ``parser`` typed in ``argv`` (``--flag v`` or ``--flag=v``).

    A parsed value cannot tell a default from the same value typed, and a flag the run will not
    use is refused only when typed.  Reading ``argv`` is exact because the project's parsers
    never guess a flag from its prefix (``allow_abbrev=False``); call it after ``parse_args``
    succeeded, so a flag-like token can only be a flag.
    """
    given: Dict[str, str] = {}
    for dest, option in _typed_options(parser, argv):
        given.setdefault(dest, option)
    return given


def _typed_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Iterator[Tuple[str, str]]:
    """``(dest, option as typed)`` of every option token of ``parser`` in ``argv``, in order."""
    dests = {option: action.dest for action in parser._actions for option in action.option_strings}
    for token in argv:
        if token == "--":
            return
        option = token.split("=", 1)[0] if token.startswith("--") else token
        if option in dests:
            yield dests[option], option


# A snake_case name (``long_count``) that is not part of a flag (``--max_total_token_num``) nor
# of a quoted value the user typed (``'promote_shortest'``).
_FIELD_NAME = re.compile(r"(?<![-\w'\"])[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
_LEADING_WORD = re.compile(r"^[a-z][a-z0-9]*\b")


def with_flag_names(parser: argparse.ArgumentParser, message: str, aliases: Optional[Mapping[str, str]] = None) -> str:
    """``message`` of a ``ValueError`` raised by a config object, its field names given as the flags.

    Config objects name their fields (``long_count must be >= 0``), which is right for a caller
    of the API, but a command line must name what the user typed (``--long-count must be >= 0``).
    Every snake_case name that is an option's ``dest`` (or a key of ``aliases``: fields whose
    flag has another name, ``settle_s`` -> ``--settle``) is replaced, and so is a one-word
    field opening the message (``seed must be``); other single words are left alone, since
    ``seed`` or ``workload`` in the middle of a sentence is usually just the word.
    """
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    flags.update(aliases or {})
    message = _FIELD_NAME.sub(lambda match: flags.get(match.group(0), match.group(0)), message)
    return _LEADING_WORD.sub(lambda match: flags.get(match.group(0), match.group(0)), message, count=1)
