"""The shape of every plugin kind's components, read from the classes that define the contract, and the
check that a component has it.

A kind's contract is a turnout class (`CONTRACTS`, by hook). A component fits it where:
- every public method the class defines (and `__call__`, and `__init__` for a kind whose classes the core
  builds) is there, an abstract one (its body only raises NotImplementedError) overridden;
- each method takes every call the contract's signature allows: its required parameters by position, the
  ones with a default by position and by name;
- every public field the class annotates is set, of the annotated type, and a callable field takes as many
  arguments as its `Callable[[...], ...]` says.
A record that names a class by `target` ("package.module:Class", imported only when chosen) has that class
checked too, from its module's source: nothing of a component runs, and no target is imported.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import types
import typing
from collections import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Union

from turnout.attention import AttentionBackend
from turnout.executor.base import Executor, ExecutorSpec
from turnout.graphs import GraphPolicy
from turnout.models import CausalLM, ModelArchitecture
from turnout.quantization import QuantizationMethod
from turnout.structured_outputs import StructuredOutputBackend
from turnout.tool_parsers import ToolParser

PROPERTY, UNREAD = "property", "unread"  # a property, and a name bound by assignment, read from source
_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Contract:
    """One kind's contract: the methods and annotated fields of `base`.

    classes: the hook returns classes, which the core builds (so `__init__` is part of it), not instances.
    optional: methods a component may leave out ("step_async"), and parameters the core passes, by name,
    only to a method that declares them ("method.parameter").
    target: the contract of the class a record names by its `target`.
    moved: (a method of an earlier API's shape, the field that replaced it, where the method went); a
    component that defines the method and lacks the field gets that as its one reason."""

    label: str
    base: type
    classes: bool = False
    optional: frozenset[str] = frozenset()
    target: Contract | None = None
    moved: tuple[tuple[str, str, str], ...] = ()

    @cached_property
    def methods(self) -> dict[str, Any]:
        """name -> the contract's attribute, for every method the core may call (a field's default is no
        method)."""
        dunders = {"__call__", "__init__"} if self.classes else {"__call__"}
        names = {
            n for k in self.base.__mro__ if _ours(k) for n in vars(k) if not n.startswith("_") or n in dunders
        }
        attrs = {n: inspect.getattr_static(self.base, n) for n in sorted(names - set(self.fields))}
        return {n: a for n, a in attrs.items() if _is_method(a)}

    @cached_property
    def fields(self) -> dict[str, Any]:
        """name -> annotated type of every public field."""
        hints = typing.get_type_hints(self.base)
        return {n: h for n, h in hints.items() if not n.startswith("_")}

    def problems(self, item: Any) -> list[str]:
        """What keeps item (a class where `classes`) from fitting, each a phrase; empty where it fits."""
        if self.classes and not isinstance(item, type):
            return [f"is {type(item).__name__}, not a class"]
        cls = item if self.classes else type(item)
        for old, field, where in self.moved:
            if inspect.getattr_static(cls, old, None) is not None and not hasattr(item, field):
                return [f"{cls.__name__} defines {old}() and no {field}: {where}"]
        why = self.method_problems(cls.__name__, lambda n: inspect.getattr_static(cls, n, None))
        why += [p for n, h in self.fields.items() for p in _field_problems(item, n, h)]
        if self.target is not None and not why:
            why += self.target_problems(item.target)
        return why

    def method_problems(self, owner: str, lookup: Callable[[str], Any]) -> list[str]:
        """What keeps the methods of class `owner` that lookup(name) finds (None: none) from fitting."""
        why = []
        for name, ours in self.methods.items():
            theirs, needed = lookup(name), name not in self.optional
            if theirs is None:
                why += [f"{owner} has no {name}()"] if needed else []
            elif theirs is ours:
                why += [f"{owner} does not implement {name}()"] if needed and _abstract(ours) else []
            elif (sig := call_signature(theirs)) is not None and (base := call_signature(ours)) is not None:
                why += _signature_problems(f"{owner}.{name}", base, sig, self.optional)
        return why

    def target_problems(self, target: str) -> list[str]:
        """What keeps the class `target` names from fitting this contract's `target`, read from source."""
        module, _, name = target.partition(":")
        if not module or not name.isidentifier():
            return [f"target {target!r} is not 'package.module:Class'"]
        attrs = read_class(module, name)
        if attrs is None:  # not readable without importing it: judged when it is chosen and loaded
            return []
        return self.target.method_problems(name, attrs.get)


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "turnout" and cls is not object


def _is_method(attr: Any) -> bool:
    return inspect.isfunction(attr) or isinstance(attr, (classmethod, staticmethod, property))


def _abstract(attr: Any) -> bool:
    """A method whose body only raises NotImplementedError (a docstring aside)."""
    fn = getattr(attr, "__func__", attr)
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_names == ("NotImplementedError",)


def call_signature(attr: Any) -> inspect.Signature | None:
    """The signature of a class attribute (a function, class or static method, or one read_class gave) as
    it is called on an instance, without self; None for a property, or where it cannot be read."""
    if isinstance(attr, inspect.Signature) or attr is None:
        return attr
    if isinstance(attr, (property, str)):
        return None
    fn = getattr(attr, "__func__", attr)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return _drop_self(sig) if not isinstance(attr, staticmethod) and inspect.isfunction(fn) else sig


def _drop_self(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:] if params and params[0].kind in _POSITIONAL else params)


def _signature_problems(
    qualname: str, base: inspect.Signature, sig: inspect.Signature, optional: frozenset[str]
) -> list[str]:
    """The first call of the contract's `base` signature that `sig` (of method `qualname`) cannot take, as a
    phrase; [] if none."""
    name = qualname.rpartition(".")[2]
    params = list(base.parameters.values())
    late = {p.name for p in params if f"{name}.{p.name}" in optional}
    pos = [p for p in params if p.kind in _POSITIONAL and p.name not in late]
    need = [p.name for p in pos if p.default is _P.empty]
    opt = [p.name for p in pos if p.default is not _P.empty]
    kw_need = [p.name for p in params if p.kind is _P.KEYWORD_ONLY and p.default is _P.empty]
    kw_opt = [p.name for p in params if p.kind is _P.KEYWORD_ONLY and p.default is not _P.empty]
    kw_opt += [n for n in late if n in sig.parameters]  # passed, by name, where declared
    calls = [(need, kw_need), (need + opt, kw_need + kw_opt), (need, opt + kw_need + kw_opt)]
    for args, kwargs in calls:
        if not _takes(sig, args, kwargs):
            call = ", ".join([*args, *(f"{k}=..." for k in kwargs)])
            return [f"{qualname}({', '.join(sig.parameters)}) cannot take the call {name}({call})"]
    return []


def _field_problems(item: Any, name: str, hint: Any) -> list[str]:
    if not hasattr(item, name):
        return [f"declares no {name}"]
    value = getattr(item, name)
    if not _fits(value, hint):
        return [f"{name} = {value!r:.40} is not {_hint_name(hint)}"]
    if (arity := _arity(hint)) is None:
        return []
    sig = call_signature(staticmethod(value) if inspect.isfunction(value) else value)
    if sig is not None and not _takes(sig, range(arity), ()):
        return [f"{name}({', '.join(sig.parameters)}) cannot take {arity} argument(s)"]
    return []


def _takes(sig: inspect.Signature, args: Iterable[Any], kwargs: Iterable[str]) -> bool:
    try:
        sig.bind(*args, **dict.fromkeys(kwargs))
    except TypeError:
        return False
    return True


def _fits(value: Any, hint: Any) -> bool:
    """value is of the annotated type; a collection hint takes any tuple, list, set or frozenset of it, and a
    hint this does not read takes anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is ClassVar:
        return _fits(value, args[0])
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is None or hint is type(None):
        return value is None
    if origin in (tuple, list, set, frozenset):
        if not isinstance(value, (tuple, list, set, frozenset)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return all(_fits(v, args[0]) for v in value) if args else True
    if origin is abc.Callable or hint is abc.Callable:
        return callable(value)
    if origin is type:
        return isinstance(value, type)
    kind = origin or hint
    return isinstance(value, kind) if isinstance(kind, type) else True


def _arity(hint: Any) -> int | None:
    """The argument count `Callable[[A, B], R]` (within ClassVar or Optional) names; None for other hints."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (ClassVar, Union, types.UnionType):
        return next((n for a in args if (n := _arity(a)) is not None), None)
    if origin is abc.Callable and args and isinstance(args[0], list):
        return len(args[0])
    return None


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is ClassVar:
        hint = typing.get_args(hint)[0]
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


# ---- a class read from its module's source ----


def read_class(module: str, name: str, depth: int = 0) -> dict[str, Any] | None:
    """The attributes of class `name` of `module`, without running that module: name -> an
    inspect.Signature (as an instance's method is called), PROPERTY or UNREAD for what the class defines,
    and the attributes of its bases. A base within the module's own package is read the same way; one
    outside it (turnout, torch) is imported. None where the source, the class or a base cannot be read."""
    source = _source(module) if depth <= 8 else None
    if source is None:
        return None
    tree, imports = source
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:  # re-exported from another module
        where = imports.get(name, "")
        return read_class(*where.rsplit(".", 1), depth + 1) if "." in where else None
    attrs: dict[str, Any] = {}
    for base in reversed(node.bases):
        expr = ast.unparse(base.value if isinstance(base, ast.Subscript) else base)  # Generic[T]: Generic
        got = _base_attrs(expr, module, tree, imports, depth)
        if got is None:
            return None
        attrs.update(got)
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            attrs[stmt.name] = _ast_signature(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            attrs.update((t.id, UNREAD) for t in targets if isinstance(t, ast.Name))
    return attrs


def _source(module: str) -> tuple[ast.Module, dict[str, str]] | None:
    """module's parsed source, and what its top-level imports bind: local name -> dotted name."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not (spec.origin or "").endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imports = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Import):
            imports.update((a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
                           for a in stmt.names)  # fmt: skip
        elif isinstance(stmt, ast.ImportFrom):
            src = importlib.util.resolve_name("." * stmt.level + (stmt.module or ""), spec.parent)
            imports.update((a.asname or a.name, f"{src}.{a.name}") for a in stmt.names)
    return tree, imports


def _base_attrs(
    expr: str, module: str, tree: ast.Module, imports: dict[str, str], depth: int
) -> dict[str, Any] | None:
    """The attributes of base class `expr` of a class in `module`."""
    head, _, rest = expr.partition(".")
    if head in imports:
        where, _, name = ".".join(filter(None, [imports[head], rest])).rpartition(".")
    elif any(isinstance(n, ast.ClassDef) and n.name == expr for n in tree.body):
        where, name = module, expr
    else:
        where, name = "builtins", expr
    if where.split(".")[0] == module.split(".")[0]:
        return read_class(where, name, depth + 1)
    try:
        cls = getattr(builtins if where == "builtins" else importlib.import_module(where), name)
    except (ImportError, AttributeError):
        return None
    return {n: inspect.getattr_static(cls, n) for n in dir(cls)} if isinstance(cls, type) else None


def _ast_signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature | str:
    """fn's signature as an instance's method is called; another decorator than these is taken to keep it
    (functools.wraps, torch.no_grad()), as inspect.signature does through __wrapped__."""
    decorators = {ast.unparse(d) for d in fn.decorator_list}
    if decorators & {"property", "cached_property", "functools.cached_property"}:
        return PROPERTY
    a = fn.args
    pos = [*a.posonlyargs, *a.args]
    first_default = len(pos) - len(a.defaults)
    params = [
        _P(x.arg, _P.POSITIONAL_ONLY if i < len(a.posonlyargs) else _P.POSITIONAL_OR_KEYWORD,
           default=None if i >= first_default else _P.empty)
        for i, x in enumerate(pos)
    ]  # fmt: skip
    params += [_P(a.vararg.arg, _P.VAR_POSITIONAL)] if a.vararg else []
    params += [
        _P(x.arg, _P.KEYWORD_ONLY, default=_P.empty if d is None else None)
        for x, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    params += [_P(a.kwarg.arg, _P.VAR_KEYWORD)] if a.kwarg else []
    sig = inspect.Signature(params)
    return sig if "staticmethod" in decorators else _drop_self(sig)


CONTRACTS: dict[str, Contract] = {
    "turnout_attention_backends": Contract(
        "attention backend",
        AttentionBackend,
        moved=(("forward", "impl_cls", "plugin API 3 moved a layer's forward to an AttentionImpl"),),
    ),
    "turnout_model_architectures": Contract(
        "model architecture", ModelArchitecture, target=Contract("model class", CausalLM)
    ),
    # step_async: only where the spec sets supports_async_scheduling
    "turnout_executors": Contract(
        "executor",
        ExecutorSpec,
        target=Contract("executor class", Executor, optional=frozenset({"step_async"})),
    ),
    "turnout_graph_policies": Contract("graph policy", GraphPolicy),
    "turnout_quantization_methods": Contract("quantization method", QuantizationMethod),
    "turnout_tool_parsers": Contract("tool-call parser", ToolParser, classes=True),
    "turnout_structured_output_backends": Contract(
        "structured-output backend", StructuredOutputBackend, classes=True
    ),
}


def misfit(hook: str, item: Any) -> str | None:
    """What keeps one component `hook` returned from fitting its kind's contract, as one phrase naming it
    ("attention backend 'x': forward(layer, q) cannot take the call forward(q, ...)"); None where it fits,
    and for a hook without a contract."""
    contract = CONTRACTS.get(hook)
    if contract is None or not (why := contract.problems(item)):
        return None
    name = getattr(item, "name", None)
    shown = repr(name) if isinstance(name, str) else getattr(item, "__name__", type(item).__name__)
    return f"{contract.label} {shown}: {'; '.join(why)}"
