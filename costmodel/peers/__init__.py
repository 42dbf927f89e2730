"""A peer's published GPU timings through the static model: ``megakernels bench --static --peer-csv FILE``.

Liger-Kernel publishes per-kernel timings (``benchmark/data/*.csv`` of its repository: ``kernel_name,
kernel_provider, kernel_operation_mode, metric_name, x_value, y_value_50, extra_benchmark_config_str, gpu_name,
liger_version``). For every ``liger`` row of an op we drive (``DRIVERS``), the liger-kernel version the row names
is imported from a scratch directory (``peer_path``), its Python entry points are run on fake CUDA tensors at the
row's shapes — exactly the launches its benchmark script times, recorded instead of run: every Triton launch
(kernel, grid, arguments, constexprs) and every PyTorch op (a GEMM, a reduction, an allocation) — and each Triton
launch is compiled for the row's GPU (``model.machine_for(gpu_name)``), read from its SASS and priced by the same
streaming model as our kernels (``model.predict_stream``). Nothing runs on a GPU.

Per Triton launch, per program (Triton's unit of work):

- instructions and MUFU operations: the SASS outside loops (cold blocks excluded) plus each loop's own code times
  its trip count; trip counts come from the Triton IR (``scf.for`` bounds evaluated from the launch's arguments at
  program 0); the i-th SASS loop is the i-th IR loop (a kernel whose loop counts differ is not modelled);
- bytes through L2: the SASS's global loads and stores (32 lanes x width, every lane counted);
- bytes that must cross DRAM: each tensor argument the IR loads from once, each it stores to once (a tensor both
  loaded and stored counts twice), unless the programs resident on the whole GPU touch more than the L2 holds, in
  which case every L2 byte is a DRAM byte (re-reads miss);
- bytes in flight: a program's loads of one loop iteration (all its loads without a loop) x resident programs.

Where a driver gives what a tensor holds and the loop bounds read it at a program-dependent place (the MoE's
per-expert token counts), each program's trips are evaluated: the launch's work is their sum, and it lasts no
less than its busiest program would as a launch of its own.

A PyTorch op costs, on the GPU: a GEMM its tiles in waves over the SMs at ``mma_sustained`` of the dtype's dense
peak (``cublas.gemm_time``: tile and wave quantization, split-K; fp32 on the CUDA cores) or its bytes at the copy
rate when slower, anything else its tensors' bytes at the copy rate; views and ``empty`` cost nothing.
Every kernel adds ``launch_s``. A ``torch.compile``d function's ops (a compiled region) are priced as Inductor
runs them (``fuse_compiled``): GEMMs as they are, the ops between them fused into one kernel of the bytes it reads
and writes outside itself, its rows read once per loop Inductor runs over them (``_row_passes``).

The benchmark harness (``triton.testing.do_bench``) times a region on CUDA events after zeroing a 256 MB buffer
(its L2 flush), so the host's work of the region overlaps the flush: the published time is the larger of the GPU
time and the host time the flush does not hide (``HOST``), all of it after a device sync (``.item()``).
"""
