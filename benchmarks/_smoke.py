"""`--smoke` for every benchmark (no Ray, no torch: the pure benchmarks use it too)."""

from __future__ import annotations


def parse_with_smoke(parser, **tiny):
    """`--smoke`: seconds instead of minutes, on the same code path, printing the same JSON
    keys (tiny sizes: `tiny` overrides the parsed arguments). The test suite runs every
    benchmark this way (tests/bench/test_benchmarks_smoke.py), so none can rot unnoticed."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, same code path and JSON keys (what CI runs)")
    args = parser.parse_args()
    if args.smoke:
        for key, value in {**tiny, "json": True}.items():
            setattr(args, key, value)
    return args
