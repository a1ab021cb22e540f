"""Options declared once, as TorchX's ``runopts`` declares a scheduler's: :class:`Options`.

A table lists a component's options, each an :class:`Option`: its name, type, default, help, whether
Airflow templates it, and how a value is checked. Everything that takes the options comes from the
table: the ``dtrain launch`` flags (:meth:`Options.add_arguments`, :meth:`Options.from_args`), an
operator's keyword parameters (:meth:`Options.keywords`) and ``template_fields``
(:attr:`Options.templated`), a dataclass's fields (:meth:`Options.fields`: the launch spec's, the ssh
settings' and the Slurm options'), the checks with their :class:`SpecError` naming the field, the value and
what is allowed (:meth:`Options.check`), and the options tables in docs/backends.md
(:meth:`Options.markdown`). A new option is one :class:`Option` in its table.

Stdlib only, beside dtrain.args and dtrain.grammar: every layer of dtrain.launch, the backend registry's
too, may declare a table, and operators read theirs when a DAG file is parsed.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from dtrain import grammar
from dtrain.args import coerce_int
from dtrain.errors import SpecError

#: ``check(field, value) -> converted value``, raising SpecError(field, value, what is allowed)
Check = Callable[[str, Any], Any]
_SAME: Any = object()  # an operator default that is the option's default


def integer(minimum: int | None = None, maximum: int | None = None) -> Check:
    """An integer within bounds; text ("2", "2.0": rendered templates) converted."""
    return lambda name, value: coerce_int(name, value, minimum=minimum, maximum=maximum)


def number(minimum: float, maximum: float) -> Check:
    """A finite number within [minimum, maximum]; text converted."""
    return lambda name, value: grammar.finite(name, value, minimum=minimum, maximum=maximum)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(name, value, "true or false")
    return value


@dataclass(frozen=True)
class Option:
    """One option of a table.

    Args:
        name: the keyword (spec field, operator parameter, ``backend_options`` key).
        type: the type of a checked value; ``int`` and ``float`` are also the flag's argparse type.
        default: the value when none is given.
        help: the flag's help and the docs' description (``{name}`` fields are filled by the table's
            ``context``, e.g. ``{backends}``: the installed backends).
        templated: the operator renders it (it is in ``template_fields``).
        check: converts and checks a given value (None passes when ``default`` is None); None: no check here.
        choices: the allowed values (a flag's choices; checked, lower-cased, when given).
        flag: the ``dtrain launch`` flag; default ``--name-with-dashes``; None: no flag.
        cli: more ``add_argument`` keywords (``metavar``, ``action``, ``dest``, a flag's own default).
        from_cli: converts the flag's value into the option's (e.g. ``KEY=VALUE`` items into a mapping).
        operator: the operator takes it as a keyword parameter.
        operator_default: the operator's default, where it differs from ``default``.
    """

    name: str
    type: Any
    default: Any = None
    help: str = ""
    templated: bool = False
    check: Check | None = None
    choices: Sequence[str] = ()
    flag: str | None = ""
    cli: Mapping[str, Any] = field(default_factory=dict)
    from_cli: Callable[[Any], Any] | None = None
    operator: bool = True
    operator_default: Any = _SAME

    @property
    def cli_flag(self) -> str | None:
        return None if self.flag is None else (self.flag or "--" + self.name.replace("_", "-"))

    @property
    def dest(self) -> str:
        """The flag's attribute in parsed arguments (argparse's: from the flag, unless ``cli`` names it)."""
        return self.cli.get("dest") or (self.cli_flag or self.name).lstrip("-").replace("-", "_")

    @property
    def keyword_default(self) -> Any:
        """The operator parameter's default."""
        return self.default if self.operator_default is _SAME else self.operator_default

    @property
    def type_name(self) -> str:
        return self.type.__name__ if isinstance(self.type, type) else str(self.type)

    def convert(self, value: Any) -> Any:
        """``value`` checked and converted (SpecError naming the option, the value and what is allowed)."""
        if value is None and self.default is None:
            return None
        if self.choices:
            value = str(value).strip().lower()
            if value not in self.choices:
                raise SpecError(self.name, value, f"one of {', '.join(self.choices)}")
        return value if self.check is None else self.check(self.name, value)


class Options:
    """An ordered table of :class:`Option` (TorchX's ``runopts``); the order is the flags' order in ``--help``.

    Args:
        options: the table's options.
        title: the ``--help`` group's title, for a backend's options (None: the parser's own options).
        prefix: a key every option's name takes in messages (``ssh.`` for ``ssh.port=...``).
    """

    def __init__(self, options: Sequence[Option], *, title: str | None = None, prefix: str = "") -> None:
        names = [o.name for o in options]
        duplicate = sorted({n for n in names if names.count(n) > 1})
        if duplicate:
            raise ValueError(f"option {duplicate[0]!r} declared twice")
        self._options = {o.name: o for o in options}
        self.title, self.prefix = title, prefix

    def __iter__(self) -> Iterator[Option]:
        return iter(self._options.values())

    def __contains__(self, name: object) -> bool:
        return name in self._options

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    def __len__(self) -> int:
        return len(self._options)

    def plus(self, *options: Option) -> "Options":
        """This table with ``options`` added at its end."""
        return Options([*self, *options], title=self.title, prefix=self.prefix)

    def subset(self, names: Sequence[str]) -> "Options":
        """The options named, in this table's order."""
        return Options([o for o in self if o.name in names], title=self.title, prefix=self.prefix)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._options)

    @property
    def templated(self) -> tuple[str, ...]:
        """The operator's ``template_fields`` among these options."""
        return tuple(o.name for o in self if o.templated and o.operator)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self}

    # -- checks ------------------------------------------------------------------------------------

    def check(self, name: str, value: Any) -> Any:
        """``value`` of option ``name``, converted and checked."""
        option = self._options[name]
        if not self.prefix:
            return option.convert(value)
        try:
            return option.convert(value)
        except SpecError as e:  # the message names the option as its component knows it (ssh.port)
            if e.field != name:
                raise
            raise SpecError(self.prefix + name, e.value, e.allowed) from None

    def check_names(self, given: Mapping[str, Any], field_name: str) -> None:
        """Refuse a key of ``given`` that is no option of this table."""
        unknown = sorted(set(given) - set(self._options))
        if unknown:
            raise SpecError(field_name, unknown[0], f"one of {', '.join(self._options)}")

    # -- a dataclass's fields -----------------------------------------------------------------------

    def fields(self, init_only: Sequence[str] = ()) -> Callable[[type], type]:
        """Decorate a class, under ``@dataclass``: one keyword-only field per option, with its type and
        default, after the class's own fields without a default and before those with one (a mutable
        default by a copy per instance); the names in ``init_only`` are ``InitVar`` (arguments of
        ``__post_init__``, e.g. what it resolves into another object). The class declares what is no option."""
        from dataclasses import InitVar
        from dataclasses import field as dataclass_field
        from types import MappingProxyType

        def declare(cls: type) -> type:
            own = dict(cls.__dict__.get("__annotations__", {}))
            clash = sorted(set(own) & set(self._options))
            if clash:
                raise TypeError(f"{cls.__name__}.{clash[0]} is declared by its options table")
            required = {name: kind for name, kind in own.items() if name not in cls.__dict__}
            annotations = dict(required)
            for option in self:
                kind = option.type if option.default is not None else option.type | None
                if option.name in init_only:
                    default = MappingProxyType(dict(option.default)) if isinstance(option.default, dict) \
                        else option.default
                    annotations[option.name] = InitVar[kind]
                    setattr(cls, option.name, dataclass_field(default=default, kw_only=True))
                    continue
                annotations[option.name] = kind
                if isinstance(option.default, (dict, list, set)):
                    made = dataclass_field(default_factory=lambda d=option.default: type(d)(d), kw_only=True)
                else:
                    made = dataclass_field(default=option.default, kw_only=True)
                setattr(cls, option.name, made)
            annotations.update((name, kind) for name, kind in own.items() if name not in required)
            cls.__annotations__ = annotations
            return cls

        return declare

    # -- the command line --------------------------------------------------------------------------

    def add_arguments(self, parser: argparse.ArgumentParser, context: Mapping[str, str] | None = None,
                      defaults: bool = True) -> None:
        """One flag per option (in the table's order; in a group of its own when the table has a title).
        ``defaults``: the flags default to the options' defaults; False: to None (only what the user set)."""
        target = parser.add_argument_group(self.title) if self.title else parser
        for option in self:
            if option.cli_flag is None:
                continue
            kwargs: dict[str, Any] = {}
            if option.type in (int, float) and option.cli.get("action") is None:
                kwargs["type"] = option.type
            if defaults and option.cli.get("action") != "append":
                kwargs["default"] = option.default
            if option.choices:
                kwargs["choices"] = tuple(option.choices)
            kwargs.update(option.cli)
            if option.help:
                kwargs["help"] = option.help.format_map(dict(context or {}))
            target.add_argument(option.cli_flag, **kwargs)

    def from_args(self, args: argparse.Namespace) -> dict[str, Any]:
        """Every option with a flag, from parsed arguments (``from_cli`` applied)."""
        values = {}
        for option in self:
            if option.cli_flag is not None:
                value = getattr(args, option.dest)
                values[option.name] = option.from_cli(value) if option.from_cli else value
        return values

    # -- operators ---------------------------------------------------------------------------------

    def keywords(self, init: Callable) -> Callable:
        """Decorate an operator's ``__init__(self, *, ..., **kwargs)``: the signature Airflow reads (its
        ``default_args``, missing-argument checks and ``expand``) and ``help()`` shows gains one keyword
        parameter per option the operator takes, with its default; ``__init__`` reads them with
        :meth:`operator_values`."""
        signature = inspect.signature(init)
        params = list(signature.parameters.values())
        # after the required parameters (``command``), before those with defaults and ``**kwargs``
        at = next((i for i, p in enumerate(params) if p.name != "self" and (p.default is not p.empty or p.kind is
                                                                            p.VAR_KEYWORD)), len(params))
        own = {p.name for p in params}
        added = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.keyword_default,
                                   annotation=o.type) for o in self if o.operator and o.name not in own]
        init.__signature__ = signature.replace(parameters=[*params[:at], *added, *params[at:]])
        return init

    def operator_values(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Take this table's operator options out of ``kwargs`` (what is left goes to BaseOperator, which
        refuses an unknown one); those not given get their operator default."""
        return {o.name: kwargs.pop(o.name, o.keyword_default) for o in self if o.operator}

    # -- the docs ----------------------------------------------------------------------------------

    def markdown(self, context: Mapping[str, str] | None = None) -> str:
        """The options as a Markdown table (docs/backends.md holds it, regenerated by
        ``python -m dtrain.launch.engine.options_doc docs/backends.md``)."""
        templated = any(o.templated and o.operator for o in self)  # a backend's options are templated as a whole
        rows = ["| option | type | default |" + (" templated |" if templated else "") + " CLI | help |",
                "|---|---|---|" + ("---|" if templated else "") + "---|---|"]
        for o in self:
            default = f"`{o.default!r}`"
            if not o.operator:
                default += " (not an operator parameter)"
            elif o.operator_default is not _SAME:
                default += f" (operator: `{o.operator_default!r}`)"
            kind = o.type_name.replace(" | ", " or ") + (f": {', '.join(o.choices)}" if o.choices else "")
            flag = f"`{o.cli_flag}`" if o.cli_flag else ""
            text = o.help.format_map(dict(context or {})).replace("|", "\\|")
            mark = (" yes |" if o.templated and o.operator else "  |") if templated else ""
            rows.append(f"| `{o.name}` | {kind} | {default} |{mark} {flag} | {text} |")
        return "\n".join(rows) + "\n"
