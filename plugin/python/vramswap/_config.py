"""VRAMSWAP_* values on the Python side: the environment checked before anything runs, and
Python values (install(limit=...)) turned into the text vramswap_configure takes.

Policy: a value is refused with the library's own message wherever the library can judge it,
so that the accepted forms are written once, in the table of src/config/config.cpp. The
Python side keeps no list of the library's keys:
  - the library's keys in the environment are checked by vramswap_configure(name, value)
    right after libvramswap.so is loaded, before any setting of the caller's: the library
    read the same values when it loaded, so applying them again changes nothing. A refusal
    is the message LD_PRELOAD prints ("VRAMSWAP_LIMIT='lots' is not valid: expected a size
    such as ..."). An unknown VRAMSWAP_* variable is not an error: the library warned about
    it when it loaded, naming the closest known key, as the preload does.
  - the package's own keys (PYTHON_KEYS; src/config/config.h's kPythonKeys names the same
    ones, which the library skips, and a test checks the two lists agree) are checked here,
    with messages of the same form.
  - a Python value is text the library judges (str, an int, an os.PathLike), or refused
    here when the library would misread it: a NUL character (C reads the text up to it:
    "8GiB\\x00junk" would be 8GiB), text that is not valid Unicode (a lone surrogate cannot
    be encoded), a float with a fractional part (the library rounds sizes down: 1.5 would
    be 1 byte), an infinite or NaN float, and any other type. A bool becomes "true" or
    "false", which the boolean keys accept and every size, count and word key refuses
    (limit=True was a 1-byte limit when True became "1"). None leaves the key unset.
Every refusal is a ConfigError (a ValueError) whose message names the variable, the value
and what is accepted.

Thread safety: pure functions, except check_environment(), which reads the process
environment and calls vramswap_configure (thread-safe in the library).
"""
import math
import numbers
import os

PREFIX = "VRAMSWAP_"

_TORCH_DEVICES = ("cpu-sim",)
EXT_CUDA_WORDS = {"": "auto", "auto": "auto",
                  "1": "extension", "on": "extension", "true": "extension", "yes": "extension",
                  "0": "ctypes", "off": "ctypes", "false": "ctypes", "no": "ctypes"}

# The package's own variables: name -> (accepted form, check(text) -> True if accepted).
# The library skips them (src/config/config.h, kPythonKeys) and refuses them in
# vramswap_configure; paths are checked when they are used (a missing file is an error then).
PYTHON_KEYS = {
    "VRAMSWAP_TORCH_DEVICE": ("cpu-sim, or unset or empty (no CPU-emulation mode at import)",
                              lambda text: text in ("",) + _TORCH_DEVICES),
    "VRAMSWAP_TORCH_EXT_CUDA": ("auto, or unset or empty (the extension when it can be built, else "
                                "the ctypes path); 1, on, true or yes (the extension only); 0, off, "
                                "false or no (the ctypes path only)",
                                lambda text: text.strip().lower() in EXT_CUDA_WORDS),
    "VRAMSWAP_LIBRARY": ("a file path", lambda text: True),
    "VRAMSWAP_CUDASIM_DIR": ("a directory path", lambda text: True),
    "VRAMSWAP_CACHE_DIR": ("a directory path", lambda text: True),
    "VRAMSWAP_TORCH_EXT": ("a file path", lambda text: True),
}


class ConfigError(ValueError):
    """A VRAMSWAP_* value vramswap refuses. str() is the messages joined by "; "; `errors`
    lists them, one per variable, each naming the variable, the value and what is accepted
    (for the library's keys, the library's own message)."""

    def __init__(self, errors):
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


def name(key):
    """The VRAMSWAP_* variable a configuration keyword names: `limit`, `LIMIT` and
    `vramswap_limit` all name VRAMSWAP_LIMIT. Raises ConfigError for a key that is not a
    str or holds a NUL."""
    if not isinstance(key, str) or "\0" in key:
        raise ConfigError([f"{key!r} is not a configuration key: expected a VRAMSWAP_* name "
                           "with or without the prefix, such as limit or VRAMSWAP_LIMIT"])
    upper = key.upper()
    return upper if upper.startswith(PREFIX) else PREFIX + upper


def conf_items(value):
    """{key: value} for VRAMSWAP_CONF's readable items, keys prefixed and upper case, by the
    library's rule (Note [VRAMSWAP_CONF] in src/config/config.cpp): items split at commas
    outside double quotes, a value in double quotes taken without them. Only for showing
    where a setting came from (vramswap doctor); the library checks the items."""
    items, current, quoted = [], "", False
    for ch in value + ",":
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            items.append(current)
            current = ""
        else:
            current += ch
    out = {}
    for item in items:
        key, colon, text = item.strip().partition(":")
        key = key.strip().upper()
        if not colon or not key or '"' in key:
            continue
        text = text.strip()
        if len(text) >= 2 and text[0] == text[-1] == '"' and text.count('"') == 2:
            text = text[1:-1]
        out[key if key.startswith(PREFIX) else PREFIX + key] = text
    return out


def _invalid(variable, shown, reason, accepted):
    """The library's form of a refusal (src/config/config.cpp, invalid_value_message)."""
    return f"{variable}={shown} is not valid" + (f" ({reason})" if reason else "") + f": expected {accepted}"


def value_text(variable, value):
    """-> the bytes vramswap_configure is given for `value`, or None for a value of None
    (the key is left as it is). Raises ConfigError naming `variable` for a value the library
    would misread (see the module's policy)."""
    accepted = ("a str (as the environment variable takes it), an int, a float with no "
                "fractional part, a bool or a path")
    if value is None:
        return None
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, numbers.Integral):
        return str(int(value)).encode()
    if isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number):
            raise ConfigError([_invalid(variable, repr(value), "not a finite number", accepted)])
        if number != math.floor(number):
            raise ConfigError([_invalid(
                variable, repr(value), "a float with a fractional part; the library would round "
                "it down", "an int, or a str with a unit such as '1.5GiB' for a fractional size")])
        return str(int(number)).encode()
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bytes):
        value = os.fsdecode(value)
    if not isinstance(value, str):
        raise ConfigError([_invalid(variable, repr(value), f"a {type(value).__name__}", accepted)])
    return text_bytes(variable, value)


def text_bytes(variable, text):
    """-> `text` as UTF-8 for the library. Raises ConfigError naming `variable` for a NUL
    character or text that cannot be encoded (a lone surrogate)."""
    nul = text.find("\0")
    if nul >= 0:
        raise ConfigError([_invalid(
            variable, repr(text), f"a NUL character at position {nul}: the library would read "
            f"only {text[:nul]!r}", "the value's text with no NUL character")])
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError([_invalid(
            variable, repr(text), f"{text[e.start:e.end]!r} at position {e.start} is not a "
            "character Unicode can encode (a lone surrogate)", "valid Unicode text")]) from None


def python_key_error(variable, text):
    """-> the refusal of `text` for one of PYTHON_KEYS, or None when it is accepted."""
    accepted, check = PYTHON_KEYS[variable]
    if check(text):
        return None
    return _invalid(variable, f"'{text}'", "", accepted)


def check_environment(lib):
    """Every VRAMSWAP_* variable of the environment, checked: the library's keys through
    vramswap_configure (call this right after libvramswap.so is loaded, before any other
    setting), the package's own here. Raises ConfigError listing every refusal, in the
    order of the names (the order in which the library and the preload report them)."""
    from . import _lib
    errors = []
    for raw_name, raw_value in sorted(os.environb.items()):
        if not raw_name.startswith(PREFIX.encode()):
            continue
        variable = os.fsdecode(raw_name)
        if variable in PYTHON_KEYS:
            error = python_key_error(variable, os.fsdecode(raw_value))
        elif lib.vramswap_configure(raw_name, raw_value) == 0:
            error = None
        else:
            error = _lib.last_error()
            if error.startswith("unknown variable"):  # warned about by the library at load
                error = None
        if error is not None:
            errors.append(error)
    if errors:
        raise ConfigError(errors)


def stop_program(error, who):
    """Prints `error`'s messages as the LD_PRELOAD library does, one "vramswap: error:" line
    each, then what stops, and exits with status 2 (SystemExit)."""
    import sys
    for message in getattr(error, "errors", None) or [str(error)]:
        print(f"vramswap: error: {message}", file=sys.stderr)
    print(f"vramswap: error: {who} stops the program (exit status 2): fix the VRAMSWAP_* value "
          "above, or unset it for the default", file=sys.stderr, flush=True)
    raise SystemExit(2)
