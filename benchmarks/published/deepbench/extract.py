"""How conv.csv and gemm.csv were read out of DeepBench's training results (kept for provenance, not run by CI).

Run in a checkout of github.com/baidu-research/DeepBench at da81ba7, in results/train/ with the workbooks renamed to
their GPU (DeepBench_NV_1080Ti.xlsx -> 1080Ti.xlsx, ..._TitanX_Pascal.xlsx, ..._V100.xlsx), with openpyxl installed
(not a pipeplan dependency): `python extract.py OUT_DIR`. Every value is copied as published; the only rows left
out are the GEMM sheets' note rows, whose time cell holds a remark.
"""
import csv
import sys

import openpyxl

SHEETS = [  # file, sheet index, profile, dtype
    ("1080Ti", 0, "gtx-1080-ti", "fp32"),
    ("TitanX_Pascal", 0, "titan-x-pascal", "fp32"),
    ("V100", 0, "v100-16gb-sxm2", "fp32"),
    ("V100", 1, "v100-16gb-sxm2", "fp16"),
]
out = sys.argv[1]
conv_rows, gemm_rows = [], []
for fname, idx, prof, dtype in SHEETS:
    wb = openpyxl.load_workbook(f"{fname}.xlsx", data_only=True)
    ws = wb.worksheets[idx]
    section, header = None, None
    for r in ws.iter_rows(values_only=True):
        vals = [x for x in r if x is not None]
        if not vals:
            continue
        if isinstance(vals[0], str) and vals[0].startswith("Dense Matrix"):
            section, header = "gemm", [str(v).strip() for v in vals[1:]]; continue
        if vals[0] == "Convolution":
            section = "conv"; continue
        if section == "conv" and vals[0] == "W":
            header = [str(v).strip() for v in vals]; continue
        if isinstance(vals[0], str) and vals[0].startswith(("Recurrent", "All-Reduce", "*")):
            section = None; continue
        if isinstance(vals[0], str) and section:  # application column (V100 sheets)
            vals = vals[1:]
        if section == "conv" and header and len(vals) >= 14:
            d = dict(zip(header, vals, strict=False))  # a row may run short of the header
            w, h, c, n, k = (int(d[x]) for x in ("W", "H", "C", "N", "K"))
            R = int(d.get("R", d.get("R (Filter height)")))
            S = int(d.get("S", d.get("S (Filter width)")))
            ph, pw = int(d["pad_h"]), int(d["pad_w"]); sh, sw = int(d["Vertical stride"]), int(d["Horizontal stride"])
            dg = d["wrt Inputs (msec)"]
            conv_rows.append(dict(profile=prof, dtype=dtype, source=fname, w=w, h=h, c=c, n=n, k=k, r=R, s=S,
                                  pad_h=ph, pad_w=pw, stride_h=sh, stride_w=sw, fwd_ms=d["Forward (msec)"],
                                  dgrad_ms="" if isinstance(dg, str) else dg, wgrad_ms=d["wrt Parameters (msec)"],
                                  p=d["P"], q=d["Q"], fwd_tflops=d["FWD TERAFLOPS"], fwd_algo=d.get("Forward Algorithm", "")))
        if section == "gemm" and header and len(vals) >= 6:
            m, nn, kk, at, bt, ms = vals[:6]
            if not isinstance(ms, (int, float)):
                continue  # a note row (its time column holds a remark)
            gemm_rows.append(dict(profile=prof, dtype=dtype, source=fname, m=m, n=nn, k=kk, a_t=at, b_t=bt, ms=ms))
for name, rows in (("conv", conv_rows), ("gemm", gemm_rows)):
    with open(f"{out}/{name}.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        for row in rows:
            wr.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    print(name, len(rows))
