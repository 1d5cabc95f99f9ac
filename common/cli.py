"""The command-line shell every service runs in: signals, shutdown, exit codes, one-line errors.

``swarm-node start``, ``swarm-tracker serve`` and ``swarm-gateway serve`` each
load their config and call :func:`run_service` with the service's trio main,
called with two keyword arguments::

    async def serve_tracker(config, *, shutdown: trio.Event, task_status) -> None:
        ...                      # start up, then task_status.started()
        await shutdown.wait()    # then drain and return

    run_service("swarm-tracker", functools.partial(serve_tracker, config), grace_s=5.0)

Signals (SIGINT, SIGTERM):

- during start-up (before ``task_status.started()``): start-up is cancelled at
  once -- a node still waiting for its tracker stops on Ctrl-C;
- once serving: ``shutdown`` is set and the service drains on its own; if it
  has not returned ``grace_s`` (+ :data:`CANCEL_MARGIN_S`) later, it is cancelled;
- a second signal ends the process immediately: after the first one both
  signals get the operating system's default action (no Python code runs, so
  it works even while a thread is inside llama.cpp). A shell then reports
  status 130 (SIGINT) or 143 (SIGTERM).

A one-shot command that needs trio (``swarm-node status --address``) runs its
main with :func:`run_once`: the same error rules, no signal handling.

Exit codes: :data:`EXIT_OK` after a requested stop (or a service that
returned by itself); :data:`EXIT_USAGE` for bad flags or settings;
:data:`EXIT_FAILED` for anything else that stopped the service.

Errors: trio reports a failed task as an exception group; the shell unwraps it
to the errors inside and prints ONE line on stderr, ``<prog>: error: <message>``.
Errors of the kinds the caller names (``usage_errors``, ``clear_errors``: a
port in use, a bad key file, a config value) are operator errors: their
traceback goes to the log at debug level only. Any other exception is a bug:
its traceback is logged at error level before the line.
"""

from __future__ import annotations

import errno
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
import trio

from common.config import Setting, settings
from common.logs import event

if TYPE_CHECKING:
    from common.tls import HttpTls

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
CANCEL_MARGIN_S = 5.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)
T = TypeVar("T")

log = logging.getLogger("swarm.cli")

ServiceMain = Callable[..., Awaitable[None]]
"""Called as ``main(shutdown=trio.Event, task_status=trio.TaskStatus)``: a service entry point such as
``functools.partial(serve_tracker, config)``."""


def fail(prog: str, message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``<prog>: error: <message>`` as one line on stderr and exit with ``code``."""
    one_line = " ".join(str(message).split())
    sys.stderr.write(f"{prog}: error: {one_line}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside ``exc`` (itself when it is not a group), depth first, in order."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


_LISTEN_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


def describe(exc: BaseException, listening: str | None = None) -> str:
    """One line for an operator: the message, or the type's name when there is none.

    ``listening`` (``"HTTP on 0.0.0.0:7460"``) names the socket a bare bind error is about
    (the HTTP servers raise ``[Errno 98] Address already in use`` without the address)."""
    text = str(exc).strip()
    if isinstance(exc, OSError):
        if exc.filename and exc.strerror and str(exc.filename) not in text:
            text = f"{exc.strerror}: {exc.filename}"
        elif listening and exc.errno in _LISTEN_ERRNOS and not exc.filename:
            text = f"cannot listen ({listening}): {exc.strerror or text}"
    text = text or type(exc).__name__
    cause = exc.__cause__
    if cause is not None and not isinstance(cause, BaseExceptionGroup):
        said = " ".join(str(cause).split())
        if said and not _shares_details(text, said):  # a wrapper that hides why: say it
            text = f"{text} ({type(cause).__name__}: {said})"
    return text


def _shares_details(text: str, cause: str, window: int = 24) -> bool:
    """Whether ``text`` already quotes ``cause`` (some run of ``window`` characters is in both)."""
    if len(text) < window:
        return text in cause
    return any(text[i : i + window] in cause for i in range(0, len(text) - window + 1, window // 3))


@dataclass
class _Run:
    stopping_signal: int | None = None
    started: bool = False
    forced: bool = False


async def _supervise(main: ServiceMain, grace_s: float, run: _Run) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        scope = nursery.cancel_scope
        listening = trio.CancelScope()

        async def on_signals(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with listening, trio.open_signal_receiver(*SIGNALS) as received:
                task_status.started()
                async for signum in received:
                    run.stopping_signal = signum
                    break
            if run.stopping_signal is None:
                return  # the service returned by itself
            # A second signal: the default action, whatever the trio thread is doing.
            for signum in SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            event(log, "stopping", signal=signal.Signals(run.stopping_signal).name, started=run.started)
            shutdown.set()
            if not run.started:
                scope.cancel()  # nothing to drain yet: stop starting
                return
            scope.deadline = trio.current_time() + grace_s + CANCEL_MARGIN_S

        await nursery.start(on_signals)
        await nursery.start(_run_main, main, shutdown, run)
        await shutdown.wait()
        if run.stopping_signal is None:
            listening.cancel()
        # Otherwise the service drains and returns; the deadline set above bounds that.
    if scope.cancelled_caught and run.started:
        run.forced = True


class _Started:
    """The task status handed to the service: records that start-up is over."""

    def __init__(self, run: _Run, outer: trio.TaskStatus[None]) -> None:
        self._run = run
        self._outer = outer

    def started(self, value: Any = None) -> None:
        self._run.started = True
        self._outer.started()


async def _run_main(
    main: ServiceMain, shutdown: trio.Event, run: _Run, *, task_status: trio.TaskStatus[None]
) -> None:
    await main(shutdown=shutdown, task_status=_Started(run, task_status))
    shutdown.set()  # the service returned by itself: the shell is done too


def run_service(
    prog: str,
    main: ServiceMain,
    *,
    grace_s: float,
    clear_errors: tuple[type[BaseException], ...] = (OSError,),
    usage_errors: tuple[type[BaseException], ...] = (),
    listening: str | None = None,
) -> NoReturn:
    """Run ``main`` in ``trio.run`` under the shell's signal rules; exit the process with its code.

    ``clear_errors``/``usage_errors``: the operator errors (exit 1 / 2, one line, no traceback);
    ``listening``: what a bare "address in use" error is about (see :func:`describe`)."""
    run = _Run()
    try:
        trio.run(_supervise, main, grace_s, run)
    except KeyboardInterrupt:  # Ctrl-C before the signal receiver was in place
        raise SystemExit(128 + signal.SIGINT) from None
    except BaseException as exc:  # noqa: BLE001 - classified below, always re-exits
        _exit_for(prog, exc, clear_errors, usage_errors, listening)
    if run.forced:
        fail(prog, f"did not stop within {grace_s + CANCEL_MARGIN_S:g} s of the signal; cancelled")
    raise SystemExit(EXIT_OK)


def run_once(
    prog: str,
    main: Callable[[], Awaitable[T]],
    *,
    clear_errors: tuple[type[BaseException], ...] = (OSError,),
) -> T:
    """A one-shot command's trio main (``swarm-node status``...): its result, or the one-line error."""
    try:
        return trio.run(main)
    except KeyboardInterrupt:
        raise SystemExit(128 + signal.SIGINT) from None
    except BaseException as exc:  # noqa: BLE001 - classified below, always re-exits
        _exit_for(prog, exc, clear_errors, (), None)


def _exit_for(
    prog: str,
    exc: BaseException,
    clear_errors: tuple[type[BaseException], ...],
    usage_errors: tuple[type[BaseException], ...],
    listening: str | None,
) -> NoReturn:
    if isinstance(exc, SystemExit):
        raise exc
    found = [e for e in leaves(exc) if not isinstance(e, trio.Cancelled | KeyboardInterrupt)]
    if not found:
        raise SystemExit(128 + signal.SIGINT)
    for kinds, code in ((usage_errors, EXIT_USAGE), (clear_errors, EXIT_FAILED)):
        for leaf in found:
            if kinds and isinstance(leaf, kinds):
                log.debug("service failed", exc_info=exc)
                fail(prog, describe(leaf, listening), code)
    leaf = found[0]
    log.error("service failed", exc_info=exc)
    fail(prog, f"internal error: {type(leaf).__name__}: {describe(leaf)} (traceback in the log above)")


# -- Options shared by the services' one-shot commands ---------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def tracker_tls_options(command: F) -> F:
    """``--tracker-tls-fingerprint`` and ``--tracker-ca-file`` of a one-shot command that calls a
    tracker (the services' own ``start``/``serve`` take them from their config schema); the command
    turns them into an :class:`common.tls.HttpTls` with :func:`tracker_http_tls`."""
    command = click.option(
        "--tracker-ca-file", default="", help="With an https:// tracker: CA bundle (PEM) to verify it."
    )(command)
    return click.option(
        "--tracker-tls-fingerprint",
        default="",
        help="With an https:// tracker: pin its certificate's sha256 (`swarm-tracker tls-fingerprint`).",
    )(command)


def tracker_http_tls(tracker_url: str, fingerprint: str, ca_file: str) -> HttpTls:
    """How to trust ``tracker_url`` given those two options, or a usage error (exit code 2) naming the
    contradiction (a pin for an http:// URL, both a pin and a CA file, ...)."""
    from common.tls import HttpTls, pin_settings_problem

    problem = pin_settings_problem("tracker", tracker_url, fingerprint, ca_file)
    if problem:
        raise click.UsageError(problem)
    return HttpTls.from_settings(fingerprint, ca_file)


# -- Options generated from a config schema (common.config.settings) --------------------------------

GENERAL_TOPIC = "Options"


class KnobOption(click.Option):
    """A command-line option made from a config field: listed under its topic by :class:`TopicCommand`,
    and showing only its own spelling (the older ones it accepts are named in its help)."""

    def __init__(self, *args: Any, topic: str, hide: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.topic = topic
        self.hide = hide

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        names, text = record
        for alias in self.hide:
            names = names.replace(f", {alias}", "")
        return names, text


class TopicCommand(click.Command):
    """A command whose ``--help`` lists its options under headings: its own options first (``Options``),
    then each topic of its config schema in the order of the schema."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {GENERAL_TOPIC: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "topic", GENERAL_TOPIC), []).append(record)
        for topic, rows in groups.items():
            if rows:
                with formatter.section(topic):
                    formatter.write_dl(rows)


def _join_repeated(ctx: click.Context, param: click.Parameter, value: Any) -> str | None:
    return ",".join(value) if value else None


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def knob_option(setting: Setting) -> Callable[[F], F]:
    """The option of one config knob: ``--name`` (a bool: ``--name/--no-name``; one named ``no_*``:
    just ``--name``), its older spellings, ``default=None`` so an option not given leaves the file,
    the environment and the default in force; its help names the file key and the variable."""
    spec = setting.knob
    decls = list(spec.aliases)
    kwargs: dict[str, Any] = {"default": None}
    if setting.kind is bool:
        if setting.name.startswith("no_"):
            decls.insert(0, setting.option)
            kwargs["is_flag"] = True
        else:
            decls.insert(0, f"{setting.option}/--no-{setting.option[2:]}")
        decls += [f" /{alias}" for alias in spec.off_aliases]
    else:
        decls.insert(0, setting.option)
        kwargs["type"] = click.Choice(spec.choices) if spec.choices else setting.kind
        if spec.repeatable:
            kwargs.update(multiple=True, callback=_join_repeated)
    also = f"also {', '.join(spec.aliases + spec.off_aliases)}; " if spec.aliases or spec.off_aliases else ""
    help_text = (
        f"{spec.help} [{also}file key {setting.name}; env {setting.env}; default {_shown(setting.default)}]"
    )
    return click.option(
        *decls,
        setting.name,
        cls=KnobOption,
        topic=spec.topic,
        hide=spec.aliases + spec.off_aliases,
        help=help_text,
        **kwargs,
    )


def config_options(config_class: type, env_prefix: str) -> Callable[[F], F]:
    """Decorate a command with one option per field of ``config_class`` (in the schema's order); the
    command gets each as a keyword argument named like the field, None when not given: the ``flags``
    of ``common.config.load_layered``. Use it with ``cls=TopicCommand`` for ``--help`` by topic."""

    def decorate(command: F) -> F:
        for setting in reversed(settings(config_class, env_prefix)):
            command = knob_option(setting)(command)
        return command

    return decorate
