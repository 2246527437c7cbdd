"""The users file on disk: read it into a ``UserBook`` (errors with file:line) and add a user to it.

Writing replaces the file atomically, readable by its owner only, so a half-written file is never
loaded and the keys are not left readable by others. Passwords are never written, only SCRAM keys.
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from collections.abc import Sequence

import yaml
from yaml.nodes import MappingNode, Node

from kproxy.config import ConfigError, read_text_file
from kproxy.identity.users import (
    MIN_ITERATIONS,
    SCRAM_MECHANISMS,
    UserBook,
    UsersError,
    new_credential,
    users_from_mapping,
    users_to_mapping,
)

HEADER = ("# kproxy users: SCRAM salt, iterations, stored and server keys per user (RFC 5802), never\n"
          "# passwords. Edit with `kproxy users add NAME --users-file FILE`.\n")


def load_users_file(path: str) -> UserBook:
    """The users in ``path``; a ConfigError with file and line says what is wrong."""
    text = read_text_file(path, "the users file")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ConfigError(f"YAML syntax error: {e.problem}", file=path, line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", file=path) from None
    try:
        return users_from_mapping(data)
    except UsersError as e:
        raise ConfigError(str(e), file=path, line=_line_of(node, e.path)) from None


def _line_of(node: Node | None, dotted: str) -> int | None:
    line = node.start_mark.line + 1 if node is not None else None
    for key in dotted.split(".") if dotted else ():
        if not isinstance(node, MappingNode):
            break
        for k, v in node.value:
            if getattr(k, "value", None) == key:
                line, node = k.start_mark.line + 1, v
                break
        else:
            break
    return line


def add_user(path: str, user: str, password: str, mechanisms: Sequence[str] = SCRAM_MECHANISMS,
             iterations: int = MIN_ITERATIONS) -> UserBook:
    """Add or replace ``user``'s credentials in ``path`` (created when missing)."""
    book = load_users_file(path) if os.path.exists(path) else UserBook()
    try:
        book = book.with_user(user, {m: new_credential(m, password, iterations) for m in mechanisms})
    except UsersError as e:
        raise ConfigError(str(e)) from None
    text = HEADER + yaml.safe_dump(users_to_mapping(book), sort_keys=False)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".users-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return book


def read_password(password_file: str | None, prompt: bool) -> str:
    """The password from ``password_file`` (its first line), else a prompt on a terminal (asked
    twice), else the first line of stdin."""
    if password_file is not None:
        with open(password_file, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    elif prompt:
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            raise ConfigError("the two passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise ConfigError("empty password")
    return password


def run_users_add(name: str, users_file: str, mechanism: str | None, password_file: str | None,
                  iterations: int) -> int:
    """``kproxy users add``: 0 when written, 2 with the reason on stderr otherwise."""
    mechanisms = (mechanism.upper(),) if mechanism else SCRAM_MECHANISMS
    for m in mechanisms:
        if m not in SCRAM_MECHANISMS:
            print(f"kproxy users add: --mechanism must be one of {', '.join(SCRAM_MECHANISMS)} (PLAIN logins "
                  "are checked against either)", file=sys.stderr)
            return 2
    if iterations < MIN_ITERATIONS:
        print(f"kproxy users add: --iterations must be at least {MIN_ITERATIONS}", file=sys.stderr)
        return 2
    try:
        password = read_password(password_file, prompt=password_file is None and sys.stdin.isatty())
        add_user(users_file, name, password, mechanisms, iterations)
    except (ConfigError, OSError) as e:
        print(f"kproxy users add: {e}", file=sys.stderr)
        return 2
    print(f"{users_file}: {name} ({', '.join(mechanisms)}, {iterations} iterations)")
    return 0
