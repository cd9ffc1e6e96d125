/* ort_op.c: ONNX Runtime custom-op library with edgespec.BlockQMatMul, BlockQMatMulHalf,
 * BlockQMatMulK, RowQMatMul, Attention (and its Int8 and Half caches) and SkipRMSNorm (CPU).
 *
 * Load with onnxruntime.SessionOptions().register_custom_ops_library(path); the runtime then
 * calls RegisterCustomOps below. Only the C ABI slice declared in ort_abi.h is used.
 *
 * BlockQMatMul(X, codes, scales, offsets) -> Y, attributes K, N, bits (int64):
 *   X float [..., K]; codes uint8 1-D (N*K*bits/8 for bits 4, 5, 6 or 8, layout in blockq.h);
 *   scales, offsets float 1-D (N*K/32); Y float [..., N] with X's leading dimensions.
 * BlockQMatMulHalf: the same with scales and offsets in float16 (half the bytes per step).
 * Optional attribute gated (int64, 0 by default): X is [..., 2K], a gated MLP's gate and up
 *   halves, and the product is taken of silu(gate) * up (blockq_silu_mul).
 * Optional attribute codebook (int64, 0 by default; bits 4 only): 1, the 4-bit codes index
 *   GGUF's IQ4 grid (blockq_iq4), whose values are the weight codes.
 * RowQMatMul(X, codes, scales) -> Y, attributes K, N: row-wise int8 (blockq.h), codes as
 *   bits 8, scales float 1-D (N); optional gated as above, and hadamard (int64, 0 by
 *   default): B, a power of two dividing K, the input's blocks of B taken through
 *   blockq_hadamard before they are quantized (a rotated down projection's input).
 * BlockQMatMulK(X, codes, scales, offsets, sub_scales, sub_offsets): K-quant tables
 *   (blockq.h), attribute sub (16 or 32, the inputs per sub-block; K % 256 == 0): scales and
 *   offsets float16 (N*K/256), sub_scales and sub_offsets int8 (N*K/sub); no codebook with
 *   sub 16.
 * SkipRMSNorm(X, skip, gamma) -> (Y, sum), attribute epsilon (float): norm.h's residual add
 *   and RMS norm, X and skip [..., K] (K % 16 == 0), gamma [K]; Y and sum X's shape.
 * X is quantized once per call (blockq_quantize_range, its rows split among threads when
 * there are enough), then the N/16 column tiles are split into contiguous ranges run on
 * ONNX Runtime's intra-op thread pool (blockq_columns).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "blockq.h"
#include "norm.h"
#include "ort_abi.h"

#ifdef _WIN32
#include <windows.h>
#define EDGESPEC_EXPORT __declspec(dllexport)
#else
#include <unistd.h>
#define EDGESPEC_EXPORT __attribute__((visibility("default")))
#endif

#define OP_NAME "BlockQMatMul"
#define OP_NAME_HALF "BlockQMatMulHalf"
#define OP_NAME_K "BlockQMatMulK"
#define OP_NAME_ROW "RowQMatMul"
#define OP_DOMAIN "edgespec"

/* Column tiles are handed out in at most TASKS_PER_CPU ranges per online CPU (the pool takes
 * them dynamically, so a few per thread even out uneven threads), and no range is given
 * less than about MIN_TASK_MACS multiply-adds so that small products stay on one thread.
 * Measured on SmolLM2 (2 threads, the variants' libraries loaded side by side in one
 * process, interleaved): since the kernel prefetches, 2^18 makes the target's one-token
 * step 0.83-0.92x as long as 2^20 did (whose q/k/v, o and down products ran on one thread
 * at M = 1, and two threads stream weights faster), longer passes and the draft head's
 * step the same within the noise; 2^22 had made the step 1.4x slower. */
#define TASKS_PER_CPU 4
#ifndef MIN_TASK_MACS
#define MIN_TASK_MACS ((int64_t)1 << 18)
#endif

typedef struct {
  const OrtApi *api; /* the table the runtime handed to create_kernel */
  int64_t K, N, bits, gated, codebook, hadamard;
  int64_t cpus;
  int half;    /* scales and offsets in IEEE half (OP_NAME_HALF, OP_NAME_K) */
  int64_t sub; /* OP_NAME_K's sub-block size, else 0 */
  int rowwise; /* OP_NAME_ROW: 8-bit codes, a scale per row and per column (blockq.h) */
} BlockQKernel;

static OrtStatus *error_in(const char *op, const OrtApi *api, OrtErrorCode code,
                           const char *fmt, ...) {
  char msg[512];
  int used = snprintf(msg, sizeof msg, "%s: ", op);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + used, sizeof msg - (size_t)used, fmt, ap);
  va_end(ap);
  return api->CreateStatus(code, msg);
}

#define op_error(api, code, ...) error_in(OP_NAME, api, code, __VA_ARGS__)

static int64_t online_cpus(void) {
#ifdef _WIN32
  SYSTEM_INFO info;
  GetSystemInfo(&info);
  int64_t n = (int64_t)info.dwNumberOfProcessors;
#else
  int64_t n = (int64_t)sysconf(_SC_NPROCESSORS_ONLN);
#endif
  return n > 0 ? n : 1;
}

/* ---- kernel creation: read and check the attributes ---- */

static OrtStatus *read_attr_of(const char *op, const OrtApi *api, const OrtKernelInfo *info,
                               const char *name, int64_t *out) {
  OrtStatus *st = api->KernelInfoGetAttribute_int64(info, name, out);
  if (st == NULL) return NULL;
  OrtStatus *err = error_in(op, api, ORT_INVALID_ARGUMENT, "needs an int64 attribute '%s' (%s)",
                            name, api->GetErrorMessage(st));
  api->ReleaseStatus(st);
  return err;
}

#define read_attr(api, info, name, out) read_attr_of(OP_NAME, api, info, name, out)

/* An int64 attribute that may be absent (0 then). */
static int64_t optional_attr(const OrtApi *api, const OrtKernelInfo *info, const char *name) {
  int64_t value = 0;
  OrtStatus *absent = api->KernelInfoGetAttribute_int64(info, name, &value);
  if (absent == NULL) return value;
  api->ReleaseStatus(absent);
  return 0;
}

static const OrtCustomOp g_op, g_op_half, g_op_k, g_op_row;

static OrtStatus *ORT_API_CALL create_kernel(const OrtCustomOp *op, const OrtApi *api,
                                             const OrtKernelInfo *info, void **kernel) {
  *kernel = NULL;
  int64_t K, N, bits;
  OrtStatus *st;
  if ((st = read_attr(api, info, "K", &K)) != NULL) return st;
  if ((st = read_attr(api, info, "N", &N)) != NULL) return st;
  if (op == &g_op_row)
    bits = 8;
  else if ((st = read_attr(api, info, "bits", &bits)) != NULL)
    return st;
  const int64_t gated = optional_attr(api, info, "gated");
  const int64_t codebook = optional_attr(api, info, "codebook");
  const int64_t hadamard = optional_attr(api, info, "hadamard");
  if (K <= 0 || K % 32 != 0)
    return op_error(api, ORT_INVALID_ARGUMENT, "K must be a positive multiple of 32, got %lld",
                    (long long)K);
  if (N <= 0 || N % 16 != 0)
    return op_error(api, ORT_INVALID_ARGUMENT, "N must be a positive multiple of 16, got %lld",
                    (long long)N);
  if (bits != 4 && bits != 5 && bits != 6 && bits != 8)
    return op_error(api, ORT_INVALID_ARGUMENT, "bits must be 4, 5, 6 or 8, got %lld",
                    (long long)bits);
  if (op == &g_op_row && codebook != 0)
    return op_error(api, ORT_INVALID_ARGUMENT, "RowQMatMul takes no codebook");
  if (hadamard != 0 && (op != &g_op_row || hadamard < 2 || (hadamard & (hadamard - 1)) != 0 ||
                        K % hadamard != 0))
    return op_error(api, ORT_INVALID_ARGUMENT, "hadamard must be 0, or on RowQMatMul a power "
                    "of two from 2 dividing K = %lld, got %lld", (long long)K, (long long)hadamard);
  if (codebook != 0 && (codebook != 1 || bits != 4))
    return op_error(api, ORT_INVALID_ARGUMENT, "codebook must be 0, or 1 with bits 4, got %lld",
                    (long long)codebook);
  int64_t sub = 0;
  if (op == &g_op_k) {
    if ((st = read_attr(api, info, "sub", &sub)) != NULL) return st;
    if (sub != 16 && sub != 32)
      return op_error(api, ORT_INVALID_ARGUMENT, "sub must be 16 or 32, got %lld", (long long)sub);
    if (K % 256 != 0)
      return op_error(api, ORT_INVALID_ARGUMENT, "K must be a multiple of 256 (super-blocks), "
                      "got %lld", (long long)K);
    if (sub == 16 && codebook != 0)
      return op_error(api, ORT_INVALID_ARGUMENT, "a codebook needs sub 32");
  }
  if (N > INT64_MAX / K)
    return op_error(api, ORT_INVALID_ARGUMENT, "K*N is too large (K=%lld, N=%lld)",
                    (long long)K, (long long)N);
  BlockQKernel *k = (BlockQKernel *)malloc(sizeof *k);
  if (k == NULL) return op_error(api, ORT_FAIL, "out of memory");
  k->api = api;
  k->K = K;
  k->N = N;
  k->bits = bits;
  k->gated = gated != 0;
  k->codebook = codebook;
  k->hadamard = hadamard;
  k->cpus = online_cpus();
  k->half = op == &g_op_half || op == &g_op_k;
  k->sub = sub;
  k->rowwise = op == &g_op_row;
  *kernel = k;
  return NULL;
}

static void ORT_API_CALL destroy_kernel(void *kernel) { free(kernel); }

/* ---- compute ---- */

/* The dimensions of v into dims (at most MAX_RANK). */
#define MAX_RANK 8
static OrtStatus *get_shape(const OrtApi *api, const OrtValue *v, int64_t dims[MAX_RANK],
                            size_t *rank) {
  OrtTensorTypeAndShapeInfo *info = NULL;
  *rank = 0;
  OrtStatus *st = api->GetTensorTypeAndShape(v, &info);
  if (st != NULL) return st;
  st = api->GetDimensionsCount(info, rank);
  if (st == NULL && *rank > MAX_RANK)
    st = op_error(api, ORT_INVALID_ARGUMENT, "takes tensors of at most %d dimensions, got %zu",
                  MAX_RANK, *rank);
  else if (st == NULL && *rank > 0)
    st = api->GetDimensions(info, dims, *rank);
  api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

/* Per call scratch: SCRATCH_KEPT bytes of the calling thread's own, taken at its first
 * call and kept for the thread's life (calls on one thread never overlap, and the pool's
 * tasks only read and write what their call hands them), so that a pass's ~1,700 small
 * buffers cost no malloc and free each. A call needing more (a long prompt's) takes its
 * own. */
#ifdef _MSC_VER
#define THREAD_LOCAL __declspec(thread)
#else
#define THREAD_LOCAL _Thread_local
#endif
#define SCRATCH_KEPT ((size_t)1 << 22)
#define SCRATCH_ALIGN 64
static THREAD_LOCAL char *kept_scratch; /* SCRATCH_KEPT bytes once a call took it */

typedef struct {
  char *base, *own; /* own: this call's buffer, freed by scratch_close */
  size_t used;
} Scratch;

/* Room for `bytes` in all (each part rounded up to SCRATCH_ALIGN); 0 when out of memory. */
static int scratch_open(Scratch *s, size_t bytes) {
  s->used = 0;
  s->own = NULL;
  if (bytes > SCRATCH_KEPT) {
    s->base = s->own = (char *)malloc(bytes);
    return s->base != NULL;
  }
  if (kept_scratch == NULL) kept_scratch = (char *)malloc(SCRATCH_KEPT);
  s->base = kept_scratch;
  return s->base != NULL;
}

static size_t scratch_size(size_t bytes) {
  return (bytes + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN;
}

static void *scratch_part(Scratch *s, size_t bytes) {
  void *part = s->base + s->used;
  s->used += scratch_size(bytes);
  return part;
}

static void scratch_close(Scratch *s) { free(s->own); }

/* Runs fn's `tasks` tasks (at least one): a single one inline, with no hand-out to the pool. */
static OrtStatus *run_tasks(const OrtApi *api, OrtKernelContext *ctx,
                            void (*fn)(void *, size_t), int64_t tasks, void *data) {
  if (tasks == 1) {
    fn(data, 0);
    return NULL;
  }
  return api->KernelContext_ParallelFor(ctx, fn, (size_t)tasks, (size_t)tasks, data);
}

/* The tasks a pass's `rows` rows of `values` values in all are split into, a run of rows
 * each: one per `min_values`, at most one per CPU and per row, at least one. */
static int64_t row_tasks(int64_t values, int64_t min_values, int64_t cpus, int64_t rows) {
  int64_t tasks = values / min_values;
  if (tasks > cpus) tasks = cpus;
  if (tasks > rows) tasks = rows;
  return tasks < 1 ? 1 : tasks;
}

/* Checks that v is 1-D with `expected` elements. */
static OrtStatus *check_vector(const OrtApi *api, const OrtValue *v, const char *what,
                               int64_t expected, const char *rule) {
  int64_t dims[MAX_RANK];
  size_t rank;
  OrtStatus *st = get_shape(api, v, dims, &rank);
  if (st != NULL) return st;
  if (rank != 1)
    st = op_error(api, ORT_INVALID_ARGUMENT, "%s must be 1-D, got rank %zu", what, rank);
  else if (dims[0] != expected)
    st = op_error(api, ORT_INVALID_ARGUMENT, "%s has %lld elements, expected %s = %lld", what,
                  (long long)dims[0], rule, (long long)expected);
  return st;
}

/* A pass's rows are quantized (and a gated product's silu taken) on the pool too once it
 * has PREPARE_MIN_VALUES inputs a task, in contiguous runs of rows: one thread took them
 * while the other waited. */
#ifndef PREPARE_MIN_VALUES
#define PREPARE_MIN_VALUES ((int64_t)1 << 13)
#endif

typedef struct {
  const float *x; /* X: [M, K], or [M, 2K] when gated (silu(gate) * up into act first) */
  float *act;     /* where X is taken first (gated, hadamard), else NULL */
  BlockqRows *rows;
  int64_t tasks, gated, hadamard;
} PrepareJob;

static void prepare_task(void *user_data, size_t i) {
  const PrepareJob *j = (const PrepareJob *)user_data;
  const int64_t M = j->rows->M, K = j->rows->K;
  const int64_t m0 = M * (int64_t)i / j->tasks, m1 = M * ((int64_t)i + 1) / j->tasks;
  const float *x = j->x;
  if (j->act != NULL) {
    float *act = j->act + m0 * K;
    if (j->gated)
      blockq_silu_mul(x + m0 * 2 * K, m1 - m0, K, act);
    else
      memcpy(act, x + m0 * K, (size_t)((m1 - m0) * K) * sizeof(float));
    if (j->hadamard) blockq_hadamard(act, m1 - m0, K, j->hadamard);
    x = j->act;
  }
  blockq_quantize_range(x, j->rows, m0, m1);
}

typedef struct {
  const BlockqRows *rows;
  BlockqWeight weight;
  float *y;
  int64_t tiles, tasks;
} ColumnsJob;

/* Task i of job->tasks: the i-th of the contiguous, near-equal ranges of column tiles. */
static void columns_task(void *user_data, size_t i) {
  const ColumnsJob *j = (const ColumnsJob *)user_data;
  int64_t begin = j->tiles * (int64_t)i / j->tasks;
  int64_t end = j->tiles * ((int64_t)i + 1) / j->tasks;
  if (begin < end)
    blockq_columns(j->rows, &j->weight, j->y, begin, end);
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
  const BlockQKernel *k = (const BlockQKernel *)kernel;
  const OrtApi *api = k->api;
  const int64_t K = k->K, N = k->N, bits = k->bits, nb = K / 32;
  const int64_t width = k->gated ? 2 * K : K; /* X's last dimension */
  OrtStatus *st;

  const size_t wanted = k->rowwise ? 3 : k->sub ? 6 : 4;
  size_t n_inputs = 0;
  if ((st = api->KernelContext_GetInputCount(ctx, &n_inputs)) != NULL) return st;
  if (n_inputs != wanted)
    return op_error(api, ORT_INVALID_ARGUMENT, "takes %zu inputs (X, codes, scales%s%s), got %zu",
                    wanted, k->rowwise ? "" : ", offsets",
                    k->sub ? ", sub_scales, sub_offsets" : "", n_inputs);
  const OrtValue *in[6];
  for (size_t i = 0; i < wanted; i++) {
    in[i] = NULL;
    if ((st = api->KernelContext_GetInput(ctx, i, &in[i])) != NULL) return st;
    if (in[i] == NULL) return op_error(api, ORT_INVALID_ARGUMENT, "input %zu is missing", i);
  }

  if ((st = check_vector(api, in[1], "codes", N * K / 8 * bits, "N*K*bits/8")) != NULL)
    return st;
  const int64_t per_table = k->rowwise ? 1 : k->sub ? K / 256 : nb;
  const int64_t per_sub = k->sub ? K / k->sub : 0;
  const char *table_rule = k->rowwise ? "N" : k->sub ? "N*K/256" : "N*K/32";
  if ((st = check_vector(api, in[2], "scales", N * per_table, table_rule)) != NULL) return st;
  if (!k->rowwise &&
      (st = check_vector(api, in[3], "offsets", N * per_table, table_rule)) != NULL)
    return st;
  if (k->sub && ((st = check_vector(api, in[4], "sub_scales", N * per_sub, "N*K/sub")) != NULL ||
                 (st = check_vector(api, in[5], "sub_offsets", N * per_sub, "N*K/sub")) != NULL))
    return st;

  int64_t dims[MAX_RANK];
  size_t rank;
  if ((st = get_shape(api, in[0], dims, &rank)) != NULL) return st;
  if (rank < 1)
    return op_error(api, ORT_INVALID_ARGUMENT, "X must have at least 1 dimension (..., K)");
  if (dims[rank - 1] != width)
    return op_error(api, ORT_INVALID_ARGUMENT, "X's last dimension is %lld, expected %lld (K = %lld%s)",
                    (long long)dims[rank - 1], (long long)width, (long long)K,
                    k->gated ? ", gated: 2K" : "");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  dims[rank - 1] = N; /* Y's shape */
  OrtValue *out = NULL;
  if ((st = api->KernelContext_GetOutput(ctx, 0, dims, rank, &out)) != NULL) return st;
  if (M == 0) return NULL;

  void *px, *pcodes, *pscales, *poffsets = NULL, *py, *psub_scales = NULL, *psub_offsets = NULL;
  if ((st = api->GetTensorMutableData((OrtValue *)in[0], &px)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[1], &pcodes)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[2], &pscales)) != NULL ||
      (!k->rowwise && (st = api->GetTensorMutableData((OrtValue *)in[3], &poffsets)) != NULL) ||
      (st = api->GetTensorMutableData(out, &py)) != NULL)
    return st;
  if (k->sub && ((st = api->GetTensorMutableData((OrtValue *)in[4], &psub_scales)) != NULL ||
                 (st = api->GetTensorMutableData((OrtValue *)in[5], &psub_offsets)) != NULL))
    return st;

  /* sub 16 keeps each half block's sums too; a gated or hadamard product its input */
  const size_t blocks = (size_t)(M * nb), halves = k->sub == 16 ? 2 * blocks : 0;
  const size_t acts = k->gated || k->hadamard ? (size_t)(M * K) * sizeof(float) : 0;
  Scratch scratch;
  if (!scratch_open(&scratch, scratch_size((size_t)(M * K)) + 3 * scratch_size(blocks * 4) +
                                  2 * scratch_size(halves * 4) + scratch_size(acts)))
    return op_error(api, ORT_FAIL, "out of memory for %lld x %lld activations", (long long)M,
                    (long long)K);
  BlockqRows rows = {(int8_t *)scratch_part(&scratch, (size_t)(M * K)),
                     (float *)scratch_part(&scratch, blocks * sizeof(float)),
                     (float *)scratch_part(&scratch, blocks * sizeof(float)),
                     (int32_t *)scratch_part(&scratch, blocks * sizeof(int32_t)), M, K,
                     halves ? (float *)scratch_part(&scratch, halves * sizeof(float)) : NULL,
                     halves ? (int32_t *)scratch_part(&scratch, halves * sizeof(int32_t)) : NULL,
                     k->rowwise};
  float *act = acts ? (float *)scratch_part(&scratch, acts) : NULL;
  PrepareJob prepare = {(const float *)px, act, &rows,
                        row_tasks(M * width, PREPARE_MIN_VALUES, k->cpus, M), k->gated,
                        k->hadamard};
  if ((st = run_tasks(api, ctx, prepare_task, prepare.tasks, &prepare)) != NULL) goto done;

  ColumnsJob job = {&rows, {(const uint8_t *)pcodes, pscales, poffsets, N, bits, k->half,
                            k->codebook ? blockq_iq4 : NULL, (const int8_t *)psub_scales,
                            (const int8_t *)psub_offsets, k->sub, k->rowwise},
                    (float *)py, N / 16, 1};
  int64_t tile_macs = 16 * K * M;
  int64_t min_tiles = (MIN_TASK_MACS + tile_macs - 1) / tile_macs;
  int64_t tasks = (job.tiles + min_tiles - 1) / min_tiles;
  if (tasks > TASKS_PER_CPU * k->cpus) tasks = TASKS_PER_CPU * k->cpus;
  if (tasks < 1) tasks = 1;
  job.tasks = tasks;
  st = run_tasks(api, ctx, columns_task, tasks, &job);

done:
  scratch_close(&scratch);
  return st;
}

/* ---- the op's schema ---- */

static const char *ORT_API_CALL op_name(const OrtCustomOp *op) {
  return op == &g_op_half ? OP_NAME_HALF : op == &g_op_k ? OP_NAME_K
         : op == &g_op_row ? OP_NAME_ROW : OP_NAME;
}
static const char *ORT_API_CALL op_provider(const OrtCustomOp *op) {
  (void)op;
  return "CPUExecutionProvider";
}
static size_t ORT_API_CALL op_input_count(const OrtCustomOp *op) {
  return op == &g_op_k ? 6 : op == &g_op_row ? 3 : 4;
}
static ONNXTensorElementDataType ORT_API_CALL op_input_type(const OrtCustomOp *op, size_t i) {
  if (i == 1) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  if (i > 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  if (i > 1 && op != &g_op && op != &g_op_row) return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL op_output_count(const OrtCustomOp *op) {
  (void)op;
  return 1;
}
static ONNXTensorElementDataType ORT_API_CALL float_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL op_required(const OrtCustomOp *op,
                                                                     size_t i) {
  (void)op;
  (void)i;
  return INPUT_OUTPUT_REQUIRED;
}
static OrtMemType ORT_API_CALL op_input_memory(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return OrtMemTypeDefault;
}
static int ORT_API_CALL op_one(const OrtCustomOp *op) {
  (void)op;
  return 1;
}

#define BLOCKQ_OP                                                                       \
  {                                                                                     \
    .version = EDGESPEC_ORT_API_VERSION, .GetName = op_name,                            \
    .GetExecutionProviderType = op_provider, .GetInputType = op_input_type,             \
    .GetInputTypeCount = op_input_count, .GetOutputType = float_type,                   \
    .GetOutputTypeCount = op_output_count, .KernelDestroy = destroy_kernel,             \
    .GetInputCharacteristic = op_required, .GetOutputCharacteristic = op_required,      \
    .GetInputMemoryType = op_input_memory, .GetVariadicInputMinArity = op_one,          \
    .GetVariadicInputHomogeneity = op_one, .GetVariadicOutputMinArity = op_one,         \
    .GetVariadicOutputHomogeneity = op_one, .CreateKernelV2 = create_kernel,            \
    .KernelComputeV2 = compute,                                                         \
  }
/* CreateKernel / KernelCompute (pre-16 entry points), shape inference, opset range and the
   aliasing hints are left NULL: the runtime skips them for this version. The four ops differ
   only in their tables (op_input_count, op_input_type, create_kernel). */
static const OrtCustomOp g_op = BLOCKQ_OP;
static const OrtCustomOp g_op_half = BLOCKQ_OP;
static const OrtCustomOp g_op_k = BLOCKQ_OP;
static const OrtCustomOp g_op_row = BLOCKQ_OP;

/* ---- Attention ---- */

/* Attention does ~8x fewer multiply-adds a microsecond than the block-quantized product
 * (float, and per key a reduction, a score and an exp), so a task needs fewer of them to
 * pay for waking a thread: a step (scores, or values) is split once it has 2^16 (a
 * one-token pass of SmolLM2 at ~100 tokens of context stays on one thread). */
#define ATTEND_MIN_TASK_MACS ((int64_t)1 << 16)
/* What a key's score, exp and weight cost a query, in multiply-adds of the other steps
 * (about 16 vector operations for 8 exps, against 16 multiply-adds an operation): counted
 * as 2 they kept a 17-token pass's softmax (153 queries of SmolLM2 over 67 keys) on one
 * thread, a fifth of its attention, while the other thread waited. */
#define SOFTMAX_MACS 32
#define ATTEND_NAME "Attention"
#define ATTEND_NAME_INT8 "AttentionInt8"
#define ATTEND_NAME_HALF "AttentionHalf"
#define attend_error(api, code, ...) error_in(ATTEND_NAME, api, code, __VA_ARGS__)

typedef struct {
  const OrtApi *api;
  int64_t H, Hk, cpus;
  float scale, softcap;
  int int8;   /* int8 caches with per-channel scales (ATTEND_NAME_INT8) */
  int halves; /* IEEE half caches (ATTEND_NAME_HALF) */
} AttendKernel;

static const OrtCustomOp g_attend_int8, g_attend_half;

static OrtStatus *ORT_API_CALL attend_create(const OrtCustomOp *op, const OrtApi *api,
                                             const OrtKernelInfo *info, void **kernel) {
  *kernel = NULL;
  int64_t H, Hk;
  float scale, softcap = 0.0f;
  OrtStatus *st;
  if ((st = read_attr_of(ATTEND_NAME, api, info, "num_heads", &H)) != NULL) return st;
  if ((st = read_attr_of(ATTEND_NAME, api, info, "kv_num_heads", &Hk)) != NULL) return st;
  if ((st = api->KernelInfoGetAttribute_float(info, "scale", &scale)) != NULL) {
    api->ReleaseStatus(st);
    return attend_error(api, ORT_INVALID_ARGUMENT, "needs a float attribute 'scale'");
  }
  if ((st = api->KernelInfoGetAttribute_float(info, "softcap", &softcap)) != NULL) {
    api->ReleaseStatus(st); /* optional */
    softcap = 0.0f;
  }
  if (H <= 0 || Hk <= 0 || H % Hk != 0)
    return attend_error(api, ORT_INVALID_ARGUMENT,
                        "num_heads (%lld) must be a positive multiple of kv_num_heads (%lld)",
                        (long long)H, (long long)Hk);
  AttendKernel *k = (AttendKernel *)malloc(sizeof *k);
  if (k == NULL) return attend_error(api, ORT_FAIL, "out of memory");
  *k = (AttendKernel){api, H, Hk, online_cpus(), scale, softcap, op == &g_attend_int8,
                      op == &g_attend_half};
  *kernel = k;
  return NULL;
}

/* The shape of v, checked to have `rank` dimensions. */
static OrtStatus *shape_of(const OrtApi *api, const OrtValue *v, const char *what, size_t rank,
                           int64_t dims[MAX_RANK]) {
  size_t got;
  OrtStatus *st = get_shape(api, v, dims, &got);
  if (st == NULL && got != rank)
    st = attend_error(api, ORT_INVALID_ARGUMENT, "%s must have %zu dimensions, got %zu", what,
                      rank, got);
  return st;
}

/* A block's rows are at most ATTEND_ROWS, and fewer where their [rows * H, T + 8] floats of
 * scores would pass ATTEND_SCORE_FLOATS: a verify pass is one block, a long prompt many. */
#define ATTEND_ROWS 32
#define ATTEND_SCORE_FLOATS ((int64_t)1 << 22)
#define ATTEND_VALUE_DIMS 64 /* a task's share of value rows: 256 bytes of floats, read in order */

/* attend_weights' scratch: scratch floats (e) and ints (pick) for each task. */
typedef struct {
  float *e;
  int32_t *pick;
  int64_t scratch;
} WeightsScratch;

static void weights_task(const AttendBlock *b, int64_t t0, int64_t t1, const WeightsScratch *w,
                         size_t task) {
  attend_weights(b, t0, t1, w->e + (int64_t)task * w->scratch,
                 w->pick + (int64_t)task * w->scratch);
}

typedef struct {
  AttendBlock block;
  int step;                    /* 0: scores, 1: weights, 2: values */
  int64_t units, tasks, per;   /* per: units per KV head (scores, values) */
  WeightsScratch weights;
} AttendJob;

static void attend_task(void *user_data, size_t i) {
  const AttendJob *j = (const AttendJob *)user_data;
  const AttendBlock *b = &j->block;
  int64_t begin = j->units * (int64_t)i / j->tasks, end = j->units * ((int64_t)i + 1) / j->tasks;
  if (j->step == 1) {
    weights_task(b, begin, end, &j->weights, i);
    return;
  }
  while (begin < end) { /* a range may run over from one KV head into the next */
    const int64_t g = begin / j->per, c0 = begin % j->per;
    const int64_t c1 = c0 + (end - begin) < j->per ? c0 + (end - begin) : j->per;
    if (j->step == 0)
      attend_scores(b, g, 8 * c0, 8 * c1 < b->U ? 8 * c1 : b->U);
    else
      attend_values(b, g, ATTEND_VALUE_DIMS * c0,
                    ATTEND_VALUE_DIMS * c1 < b->a->D ? ATTEND_VALUE_DIMS * c1 : b->a->D);
    begin += c1 - c0;
  }
}

/* One step of a block over `units`, on the pool once it has ATTEND_MIN_TASK_MACS a task. */
static OrtStatus *attend_step(const OrtApi *api, OrtKernelContext *ctx, AttendJob *j,
                              int64_t cpus, int step, int64_t units, int64_t per,
                              int64_t macs) {
  int64_t tasks = macs / ATTEND_MIN_TASK_MACS;
  if (tasks > TASKS_PER_CPU * cpus) tasks = TASKS_PER_CPU * cpus;
  if (tasks > units) tasks = units;
  if (tasks < 1) tasks = 1;
  j->step = step;
  j->units = units;
  j->tasks = tasks;
  j->per = per;
  return run_tasks(api, ctx, attend_task, tasks, j);
}

/* A pass of more than one token that fits one block (a verify pass) runs as units of a run
 * of its rows and a KV head, each taking its scores, weights and values in turn on one
 * thread: one hand-out to the pool instead of three, whose waits had cost a 17-token pass
 * of SmolLM2 the second thread's gain (its attention 65 us a layer on 2 threads, 70 on 1).
 * A query's arithmetic is the same in any block (attend.h), so are its bits. */
typedef struct {
  const AttendBlock *blocks;
  int64_t Hk, group; /* KV heads; query heads a KV head */
  WeightsScratch weights;
} UnitJob;

static void unit_task(void *user_data, size_t i) {
  const UnitJob *j = (const UnitJob *)user_data;
  const AttendBlock *b = &j->blocks[(int64_t)i / j->Hk];
  const int64_t g = (int64_t)i % j->Hk, H = b->a->H;
  attend_scores(b, g, 0, b->U);
  for (int64_t s = b->r0; s < b->r1; ++s) {
    const int64_t t0 = (s - b->r0) * H + g * j->group;
    weights_task(b, t0, t0 + j->group, &j->weights, i);
  }
  attend_values(b, g, 0, b->a->D);
}

enum { A_Q, A_K, A_V, A_PAST_K, A_PAST_V, A_COS, A_SIN, A_POS, A_BIAS, A_INPUTS,
       A_K_SCALE = A_INPUTS, A_V_SCALE, A_INPUTS_INT8 };

static OrtStatus *ORT_API_CALL attend_compute(void *kernel, OrtKernelContext *ctx) {
  const AttendKernel *k = (const AttendKernel *)kernel;
  const OrtApi *api = k->api;
  const int64_t H = k->H, Hk = k->Hk;
  const size_t inputs = k->int8 ? A_INPUTS_INT8 : A_INPUTS;
  const OrtValue *in[A_INPUTS_INT8];
  OrtStatus *st;
  for (size_t i = 0; i < inputs; i++) {
    in[i] = NULL;
    if ((st = api->KernelContext_GetInput(ctx, i, &in[i])) != NULL) return st;
    if (in[i] == NULL && i != A_K && i != A_V)
      return attend_error(api, ORT_INVALID_ARGUMENT, "input %zu is missing", i);
  }
  const int packed = in[A_K] == NULL;
  if (packed != (in[A_V] == NULL))
    return attend_error(api, ORT_INVALID_ARGUMENT, "key and value come both or neither");

  int64_t q[MAX_RANK], kd[MAX_RANK], vd[MAX_RANK], cache[MAX_RANK], vcache[MAX_RANK],
      cs[MAX_RANK], sn[MAX_RANK], pos[MAX_RANK], bias[MAX_RANK], ks[MAX_RANK], vs[MAX_RANK];
  Scratch buffer = {NULL, NULL, 0};
  AttendShape a = {0};
  if ((st = shape_of(api, in[A_Q], "query", 3, q)) != NULL ||
      (st = shape_of(api, in[A_PAST_K], "past_key", 4, cache)) != NULL ||
      (st = shape_of(api, in[A_PAST_V], "past_value", 4, vcache)) != NULL ||
      (st = shape_of(api, in[A_COS], "cos_cache", 2, cs)) != NULL ||
      (st = shape_of(api, in[A_SIN], "sin_cache", 2, sn)) != NULL ||
      (st = shape_of(api, in[A_POS], "position_ids", 2, pos)) != NULL ||
      (st = shape_of(api, in[A_BIAS], "attention_bias", 4, bias)) != NULL ||
      (!packed && (st = shape_of(api, in[A_K], "key", 3, kd)) != NULL) ||
      (!packed && (st = shape_of(api, in[A_V], "value", 3, vd)) != NULL) ||
      (k->int8 && (st = shape_of(api, in[A_K_SCALE], "k_scale", 3, ks)) != NULL) ||
      (k->int8 && (st = shape_of(api, in[A_V_SCALE], "v_scale", 3, vs)) != NULL))
    goto done;
  const int64_t S = q[1], D = cache[3], T = bias[3];
  a = (AttendShape){S, H, Hk, D, cs[1], T - S, cache[2], k->scale, k->softcap, NULL, NULL,
                    k->halves};
  const int64_t width = packed ? (H + 2 * Hk) * D : H * D;
#define ATTEND_CHECK(cond, ...)                                 \
  if (!(cond)) {                                                \
    st = attend_error(api, ORT_INVALID_ARGUMENT, __VA_ARGS__); \
    goto done;                                                  \
  }
  ATTEND_CHECK(q[0] == 1, "takes one sequence, got a batch of %lld", (long long)q[0]);
  ATTEND_CHECK(cache[0] == 1 && cache[1] == Hk && D > 0 && D % 8 == 0,
               "past_key must be [1, kv_num_heads=%lld, max, D] with D a multiple of 8",
               (long long)Hk);
  for (int i = 0; i < 4; i++)
    ATTEND_CHECK(vcache[i] == cache[i], "past_value's shape must be past_key's");
  ATTEND_CHECK(q[2] == width, "query's last dimension is %lld, expected %lld", (long long)q[2],
               (long long)width);
  ATTEND_CHECK(packed || (kd[0] == 1 && kd[1] == S && kd[2] == Hk * D && vd[0] == 1 &&
                          vd[1] == S && vd[2] == Hk * D),
               "key and value must be [1, S, kv_num_heads * D]");
  ATTEND_CHECK(sn[0] == cs[0] && sn[1] == cs[1] && 2 * cs[1] <= D,
               "cos_cache and sin_cache must be [positions, rotary half <= D/2]");
  ATTEND_CHECK(pos[0] == 1 && pos[1] == S, "position_ids must be [1, S]");
  ATTEND_CHECK(!k->int8 || (ks[0] == Hk && ks[1] == 1 && ks[2] == D && vs[0] == Hk &&
                            vs[1] == 1 && vs[2] == D),
               "k_scale and v_scale must be [kv_num_heads, 1, D]");
  ATTEND_CHECK(bias[0] == 1 && bias[1] == 1 && bias[2] == S && T >= S && T <= a.max,
               "attention_bias must be [1, 1, S, past + S] with past + S <= the cache length");
  const int64_t *positions;
  void *pq, *pk = NULL, *pv = NULL, *ppk, *ppv, *pcos, *psin, *pbias, *pout, *ppresk, *ppresv;
  if ((st = api->GetTensorMutableData((OrtValue *)in[A_Q], &pq)) != NULL ||
      (!packed && (st = api->GetTensorMutableData((OrtValue *)in[A_K], &pk)) != NULL) ||
      (!packed && (st = api->GetTensorMutableData((OrtValue *)in[A_V], &pv)) != NULL) ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_PAST_K], &ppk)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_PAST_V], &ppv)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_COS], &pcos)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_SIN], &psin)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_POS], (void **)&positions)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[A_BIAS], &pbias)) != NULL ||
      (k->int8 && (st = api->GetTensorMutableData((OrtValue *)in[A_K_SCALE],
                                                  (void **)&a.kscale)) != NULL) ||
      (k->int8 && (st = api->GetTensorMutableData((OrtValue *)in[A_V_SCALE],
                                                  (void **)&a.vscale)) != NULL))
    goto done;
  for (int64_t s = 0; s < S; s++)
    ATTEND_CHECK(positions[s] >= 0 && positions[s] < cs[0],
                 "position %lld is outside the rotary tables' %lld", (long long)positions[s],
                 (long long)cs[0]);
#undef ATTEND_CHECK
  int64_t out_dims[3] = {1, S, H * D};
  OrtValue *out, *present_k, *present_v;
  if ((st = api->KernelContext_GetOutput(ctx, 0, out_dims, 3, &out)) != NULL ||
      (st = api->KernelContext_GetOutput(ctx, 1, cache, 4, &present_k)) != NULL ||
      (st = api->KernelContext_GetOutput(ctx, 2, cache, 4, &present_v)) != NULL ||
      (st = api->GetTensorMutableData(out, &pout)) != NULL ||
      (st = api->GetTensorMutableData(present_k, &ppresk)) != NULL ||
      (st = api->GetTensorMutableData(present_v, &ppresv)) != NULL)
    goto done;
  /* The runtime binds one buffer as past and present (written in place); otherwise the
     present starts as a copy of the past. */
  const size_t cache_bytes = (size_t)(Hk * a.max * D) * (k->int8 ? 1 : k->halves ? 2 : 4);
  if (ppresk != ppk) memcpy(ppresk, ppk, cache_bytes);
  if (ppresv != ppv) memcpy(ppresv, ppv, cache_bytes);
  if (S == 0) goto done;

  int64_t rows = ATTEND_SCORE_FLOATS / (H * (T + 8));
  rows = rows > ATTEND_ROWS ? ATTEND_ROWS : (rows < 1 ? 1 : rows);
  rows = rows > S ? S : rows;
  const int64_t scratch = T + 8;
  int64_t most = TASKS_PER_CPU * k->cpus < rows * H ? TASKS_PER_CPU * k->cpus : rows * H;
  const int64_t units_worth = S * H * T * (2 * D + SOFTMAX_MACS) / ATTEND_MIN_TASK_MACS;
  int64_t blocks = 0; /* a verify pass's blocks of units (0: the three steps in turn) */
  if (S > 1 && rows == S && units_worth >= Hk) {
    blocks = (TASKS_PER_CPU * k->cpus + Hk - 1) / Hk;
    if (blocks > units_worth / Hk) blocks = units_worth / Hk;
    if (blocks > S) blocks = S;
    if (most < blocks * Hk) most = blocks * Hk;
  }
  const size_t qrot_bytes = (size_t)(S * H * D) * sizeof(float),
               keys_bytes = (size_t)((blocks ? blocks : 1) * scratch) * sizeof(int32_t),
               w_bytes = (size_t)(rows * H * (scratch + 1)) * sizeof(float),
               e_bytes = (size_t)(most * scratch + D) * sizeof(float), /* and prepare's D */
               pick_bytes = (size_t)(most * scratch) * sizeof(int32_t);
  if (!scratch_open(&buffer, scratch_size(qrot_bytes) + scratch_size(keys_bytes) +
                                  scratch_size(w_bytes) + scratch_size(e_bytes) +
                                  scratch_size(pick_bytes))) {
    st = attend_error(api, ORT_FAIL, "out of memory");
    goto done;
  }
  float *qrot = (float *)scratch_part(&buffer, qrot_bytes);
  int32_t *keys = (int32_t *)scratch_part(&buffer, keys_bytes);
  float *w = (float *)scratch_part(&buffer, w_bytes);
  float *e = (float *)scratch_part(&buffer, e_bytes);
  int32_t *pick = (int32_t *)scratch_part(&buffer, pick_bytes);
  const float *fq = (const float *)pq;
  attend_prepare(&a, fq, q[2], packed ? fq + H * D : (const float *)pk, packed ? q[2] : Hk * D,
                 packed ? fq + (H + Hk) * D : (const float *)pv, packed ? q[2] : Hk * D,
                 positions, (const float *)pcos, (const float *)psin, qrot, ppresk, ppresv, e);
  if (blocks) {
    AttendBlock units[ATTEND_ROWS];
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = S * i / blocks, r1 = S * (i + 1) / blocks, n = (r1 - r0) * H;
      int32_t *seen = keys + i * scratch;
      float *scores = w + r0 * H * (scratch + 1);
      units[i] = (AttendBlock){&a, qrot, (const float *)pbias, ppresk, ppresv, (float *)pout,
                               r0, r1, seen, attend_keys(&a, (const float *)pbias, r0, r1, seen),
                               scores, scores + n * scratch};
    }
    UnitJob job = {units, Hk, H / Hk, {e, pick, scratch}};
    st = api->KernelContext_ParallelFor(ctx, unit_task, (size_t)(blocks * Hk),
                                        (size_t)(blocks * Hk), &job);
    goto done;
  }
  for (int64_t r0 = 0; r0 < S && st == NULL; r0 += rows) {
    const int64_t r1 = r0 + rows < S ? r0 + rows : S, n = (r1 - r0) * H;
    const int64_t U = attend_keys(&a, (const float *)pbias, r0, r1, keys);
    AttendJob job = {{&a, qrot, (const float *)pbias, ppresk, ppresv, (float *)pout, r0, r1,
                      keys, U, w, w + n * scratch},
                     0, 0, 0, 0, {e, pick, scratch}};
    const int64_t dims = (D + ATTEND_VALUE_DIMS - 1) / ATTEND_VALUE_DIMS;
    if ((st = attend_step(api, ctx, &job, k->cpus, 0, Hk * ((U + 7) / 8), (U + 7) / 8,
                          n * U * D)) != NULL ||
        (st = attend_step(api, ctx, &job, k->cpus, 1, n, 0, n * U * SOFTMAX_MACS)) != NULL)
      break;
    st = attend_step(api, ctx, &job, k->cpus, 2, Hk * dims, dims, n * U * D);
  }

done:
  scratch_close(&buffer);
  return st;
}

static const char *ORT_API_CALL attend_name(const OrtCustomOp *op) {
  return op == &g_attend_int8 ? ATTEND_NAME_INT8 : op == &g_attend_half ? ATTEND_NAME_HALF
                                                                       : ATTEND_NAME;
}
/* The element type of the caches (past and present). */
static ONNXTensorElementDataType attend_cache_type(const OrtCustomOp *op) {
  return op == &g_attend_int8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
         : op == &g_attend_half ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL attend_input_count(const OrtCustomOp *op) {
  return op == &g_attend_int8 ? A_INPUTS_INT8 : A_INPUTS;
}
static ONNXTensorElementDataType ORT_API_CALL attend_input_type(const OrtCustomOp *op,
                                                                size_t i) {
  if (i == A_POS) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  return i == A_PAST_K || i == A_PAST_V ? attend_cache_type(op)
                                         : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static ONNXTensorElementDataType ORT_API_CALL attend_output_type(const OrtCustomOp *op,
                                                                 size_t i) {
  return i > 0 ? attend_cache_type(op) : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL attend_output_count(const OrtCustomOp *op) {
  (void)op;
  return 3;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL attend_input_required(
    const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == A_K || i == A_V ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
}

/* Attention(query, key?, value?, past_key, past_value, cos_cache, sin_cache, position_ids,
 *           attention_bias) -> (output, present_key, present_value), attend.h's exact
 * attention with GroupQueryAttention's inputs: query [1,S,H*D] (or q, k and v packed when
 * key and value are omitted), the caches [1,Hk,max,D] written in place at slots past..past+S-1
 * (past = T - S), attention_bias [1,1,S,T]. Attributes num_heads, kv_num_heads (int64), scale
 * and the optional softcap (float). AttentionInt8: the caches are int8 codes, with two more
 * inputs k_scale and v_scale [kv_num_heads, 1, D] (float). AttentionHalf: the caches are
 * float16 (half the bytes to read a step: at long context the caches outweigh the
 * weights). */
#define ATTEND_OP                                                                           \
  {                                                                                         \
    .version = EDGESPEC_ORT_API_VERSION, .GetName = attend_name,                            \
    .GetExecutionProviderType = op_provider, .GetInputType = attend_input_type,             \
    .GetInputTypeCount = attend_input_count, .GetOutputType = attend_output_type,           \
    .GetOutputTypeCount = attend_output_count, .KernelDestroy = destroy_kernel,             \
    .GetInputCharacteristic = attend_input_required, .GetOutputCharacteristic = op_required, \
    .GetInputMemoryType = op_input_memory, .GetVariadicInputMinArity = op_one,              \
    .GetVariadicInputHomogeneity = op_one, .GetVariadicOutputMinArity = op_one,             \
    .GetVariadicOutputHomogeneity = op_one, .CreateKernelV2 = attend_create,                \
    .KernelComputeV2 = attend_compute,                                                      \
  }
static const OrtCustomOp g_attend = ATTEND_OP;
static const OrtCustomOp g_attend_int8 = ATTEND_OP;
static const OrtCustomOp g_attend_half = ATTEND_OP;

/* ---- SkipRMSNorm ---- */

#define NORM_NAME "SkipRMSNorm"
/* A pass's rows go to the pool once it has NORM_MIN_VALUES values a task (a prompt's): a
 * verify pass's few rows take less time than waking a thread. */
#define NORM_MIN_VALUES ((int64_t)1 << 15)
#define norm_error(api, code, ...) error_in(NORM_NAME, api, code, __VA_ARGS__)

typedef struct {
  const OrtApi *api;
  float eps;
  int64_t cpus;
} NormKernel;

static OrtStatus *ORT_API_CALL norm_create(const OrtCustomOp *op, const OrtApi *api,
                                           const OrtKernelInfo *info, void **kernel) {
  (void)op;
  *kernel = NULL;
  float eps;
  OrtStatus *absent = api->KernelInfoGetAttribute_float(info, "epsilon", &eps);
  if (absent != NULL) {
    api->ReleaseStatus(absent);
    return norm_error(api, ORT_INVALID_ARGUMENT, "needs a float attribute 'epsilon'");
  }
  NormKernel *k = (NormKernel *)malloc(sizeof *k);
  if (k == NULL) return norm_error(api, ORT_FAIL, "out of memory");
  *k = (NormKernel){api, eps, online_cpus()};
  *kernel = k;
  return NULL;
}

typedef struct {
  const float *x, *skip, *gamma;
  float *y, *sum;
  int64_t M, K, tasks;
  float eps;
} NormJob;

static void norm_task(void *user_data, size_t i) {
  const NormJob *j = (const NormJob *)user_data;
  const int64_t m0 = j->M * (int64_t)i / j->tasks, m1 = j->M * ((int64_t)i + 1) / j->tasks;
  norm_skip_rms(j->x + m0 * j->K, j->skip + m0 * j->K, j->gamma, m1 - m0, j->K, j->eps,
                j->y + m0 * j->K, j->sum + m0 * j->K);
}

static OrtStatus *ORT_API_CALL norm_compute(void *kernel, OrtKernelContext *ctx) {
  const NormKernel *k = (const NormKernel *)kernel;
  const OrtApi *api = k->api;
  const OrtValue *in[3];
  OrtStatus *st;
  for (size_t i = 0; i < 3; i++) {
    in[i] = NULL;
    if ((st = api->KernelContext_GetInput(ctx, i, &in[i])) != NULL) return st;
    if (in[i] == NULL) return norm_error(api, ORT_INVALID_ARGUMENT, "input %zu is missing", i);
  }
  int64_t dims[MAX_RANK], skip[MAX_RANK], gamma[MAX_RANK];
  size_t rank, skip_rank, gamma_rank;
  if ((st = get_shape(api, in[0], dims, &rank)) != NULL ||
      (st = get_shape(api, in[1], skip, &skip_rank)) != NULL ||
      (st = get_shape(api, in[2], gamma, &gamma_rank)) != NULL)
    return st;
  if (rank < 1 || skip_rank != rank || memcmp(dims, skip, rank * sizeof *dims) != 0)
    return norm_error(api, ORT_INVALID_ARGUMENT, "skip must have X's shape");
  const int64_t K = dims[rank - 1];
  if (gamma_rank != 1 || gamma[0] != K || K % 16 != 0)
    return norm_error(api, ORT_INVALID_ARGUMENT, "gamma must be [K], K (X's last dimension, "
                      "%lld) a multiple of 16", (long long)K);
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  OrtValue *out = NULL, *sum = NULL;
  void *px, *pskip, *pgamma, *py, *psum;
  if ((st = api->KernelContext_GetOutput(ctx, 0, dims, rank, &out)) != NULL ||
      (st = api->KernelContext_GetOutput(ctx, 1, dims, rank, &sum)) != NULL)
    return st;
  if (M == 0) return NULL;
  if ((st = api->GetTensorMutableData((OrtValue *)in[0], &px)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[1], &pskip)) != NULL ||
      (st = api->GetTensorMutableData((OrtValue *)in[2], &pgamma)) != NULL ||
      (st = api->GetTensorMutableData(out, &py)) != NULL ||
      (st = api->GetTensorMutableData(sum, &psum)) != NULL)
    return st;
  NormJob job = {(const float *)px, (const float *)pskip, (const float *)pgamma, (float *)py,
                 (float *)psum, M, K, row_tasks(M * K, NORM_MIN_VALUES, k->cpus, M), k->eps};
  return run_tasks(api, ctx, norm_task, job.tasks, &job);
}

static const char *ORT_API_CALL norm_name(const OrtCustomOp *op) {
  (void)op;
  return NORM_NAME;
}
static size_t ORT_API_CALL norm_input_count(const OrtCustomOp *op) {
  (void)op;
  return 3;
}
static size_t ORT_API_CALL norm_output_count(const OrtCustomOp *op) {
  (void)op;
  return 2;
}
static const OrtCustomOp g_norm = {
    .version = EDGESPEC_ORT_API_VERSION, .GetName = norm_name,
    .GetExecutionProviderType = op_provider, .GetInputType = float_type,
    .GetInputTypeCount = norm_input_count, .GetOutputType = float_type,
    .GetOutputTypeCount = norm_output_count, .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = op_required, .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_input_memory, .GetVariadicInputMinArity = op_one,
    .GetVariadicInputHomogeneity = op_one, .GetVariadicOutputMinArity = op_one,
    .GetVariadicOutputHomogeneity = op_one, .CreateKernelV2 = norm_create,
    .KernelComputeV2 = norm_compute,
};

/* ---- entry point ---- */

EDGESPEC_EXPORT OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options,
                                                          const OrtApiBase *api_base) {
  const OrtApi *api = api_base->GetApi(EDGESPEC_ORT_API_VERSION);
  if (api == NULL) {
    /* Too old a runtime for our table; CreateStatus is slot 0 of every version's table. */
    const OrtApi *v1 = api_base->GetApi(1);
    if (v1 == NULL) return NULL;
    char msg[256];
    snprintf(msg, sizeof msg,
             "edgespec kernels need ONNX Runtime API version %d (onnxruntime >= 1.%d); this is "
             "onnxruntime %s",
             EDGESPEC_ORT_API_VERSION, EDGESPEC_ORT_API_VERSION, api_base->GetVersionString());
    return v1->CreateStatus(ORT_FAIL, msg);
  }
  /* The domain must outlive every session using it; it is never released (one small object
     per registration). */
  OrtCustomOpDomain *domain = NULL;
  OrtStatus *st = api->CreateCustomOpDomain(OP_DOMAIN, &domain);
  if (st != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_op)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_op_half)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_op_k)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_op_row)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_attend)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_attend_int8)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_attend_half)) != NULL) return st;
  if ((st = api->CustomOpDomain_Add(domain, &g_norm)) != NULL) return st;
  return api->AddCustomOpDomain(options, domain);
}
