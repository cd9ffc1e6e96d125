/* ort_abi.h: the slice of ONNX Runtime's stable C ABI that ort_op.c uses.
 *
 * Self-written (not ONNX Runtime's header): only the entries we call are declared, every
 * other slot of the OrtApi function table is an opaque pointer of padding. The layout is
 * ABI-compatible with ONNX Runtime's C API version 17 (onnxruntime 1.17), and therefore with
 * every later runtime: the table only ever grows at its end, so a slot's index never changes.
 * Slot indices are zero-based positions of function pointers in the table; the
 * _Static_asserts at the end of this file pin each one.
 */
#ifndef EDGESPEC_ORT_ABI_H
#define EDGESPEC_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The API version whose table (through slot 274) and OrtCustomOp fields we rely on. */
#define EDGESPEC_ORT_API_VERSION 17

/* Calling convention of every function pointer in the ABI (only differs on 32-bit Windows). */
#ifndef ORT_API_CALL
#ifdef _WIN32
#define ORT_API_CALL __stdcall
#else
#define ORT_API_CALL
#endif
#endif

/* Opaque handles; only ever used through pointers. */
typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtCustomOp OrtCustomOp; /* defined below */

/* ONNX tensor element types (the values of onnx's TensorProto.DataType): the ones we use. */
typedef enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED = 0,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT = 1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 = 2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 = 3,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 = 7,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 = 10,
} ONNXTensorElementDataType;

/* Status codes (the ones we raise; the runtime's enum has more). */
typedef enum OrtErrorCode {
  ORT_OK = 0,
  ORT_FAIL = 1,
  ORT_INVALID_ARGUMENT = 2,
} OrtErrorCode;

/* Where an input lives; 0 = the execution provider's default memory. */
typedef enum OrtMemType { OrtMemTypeDefault = 0 } OrtMemType;

typedef enum OrtCustomOpInputOutputCharacteristic {
  INPUT_OUTPUT_REQUIRED = 0,
  INPUT_OUTPUT_OPTIONAL = 1,
  INPUT_OUTPUT_VARIADIC = 2,
} OrtCustomOpInputOutputCharacteristic;

typedef struct OrtApi OrtApi;

/* What RegisterCustomOps receives: the entry point to the versioned table. */
typedef struct OrtApiBase {
  const OrtApi *(ORT_API_CALL *GetApi)(uint32_t version); /* NULL if the runtime is older */
  const char *(ORT_API_CALL *GetVersionString)(void);
} OrtApiBase;

/* Padding for the table slots from..to (inclusive) that we never call. */
#define ORT_ABI_PAD(from, to) void *_pad_##from##_to_##to[(to) - (from) + 1]

struct OrtApi {
  /* 0 */ OrtStatus *(ORT_API_CALL *CreateStatus)(OrtErrorCode code, const char *msg);
  /* 1 */ OrtErrorCode (ORT_API_CALL *GetErrorCode)(const OrtStatus *status);
  /* 2 */ const char *(ORT_API_CALL *GetErrorMessage)(const OrtStatus *status);
  ORT_ABI_PAD(3, 25);
  /* 26 */ OrtStatus *(ORT_API_CALL *CreateCustomOpDomain)(const char *domain,
                                                            OrtCustomOpDomain **out);
  /* 27 */ OrtStatus *(ORT_API_CALL *CustomOpDomain_Add)(OrtCustomOpDomain *domain,
                                                          const OrtCustomOp *op);
  /* 28 */ OrtStatus *(ORT_API_CALL *AddCustomOpDomain)(OrtSessionOptions *options,
                                                         OrtCustomOpDomain *domain);
  ORT_ABI_PAD(29, 50);
  /* 51 */ OrtStatus *(ORT_API_CALL *GetTensorMutableData)(OrtValue *value, void **out);
  ORT_ABI_PAD(52, 60);
  /* 61 */ OrtStatus *(ORT_API_CALL *GetDimensionsCount)(const OrtTensorTypeAndShapeInfo *info,
                                                          size_t *out);
  /* 62 */ OrtStatus *(ORT_API_CALL *GetDimensions)(const OrtTensorTypeAndShapeInfo *info,
                                                     int64_t *dims, size_t dims_length);
  ORT_ABI_PAD(63, 64);
  /* 65 */ OrtStatus *(ORT_API_CALL *GetTensorTypeAndShape)(const OrtValue *value,
                                                             OrtTensorTypeAndShapeInfo **out);
  ORT_ABI_PAD(66, 84);
  /* 85 */ OrtStatus *(ORT_API_CALL *KernelInfoGetAttribute_float)(const OrtKernelInfo *info,
                                                                    const char *name, float *out);
  /* 86 */ OrtStatus *(ORT_API_CALL *KernelInfoGetAttribute_int64)(const OrtKernelInfo *info,
                                                                    const char *name,
                                                                    int64_t *out);
  ORT_ABI_PAD(87, 87);
  /* 88 */ OrtStatus *(ORT_API_CALL *KernelContext_GetInputCount)(const OrtKernelContext *ctx,
                                                                   size_t *out);
  /* 89 */ OrtStatus *(ORT_API_CALL *KernelContext_GetOutputCount)(const OrtKernelContext *ctx,
                                                                    size_t *out);
  /* 90 */ OrtStatus *(ORT_API_CALL *KernelContext_GetInput)(const OrtKernelContext *ctx,
                                                              size_t index, const OrtValue **out);
  /* 91 */ OrtStatus *(ORT_API_CALL *KernelContext_GetOutput)(OrtKernelContext *ctx, size_t index,
                                                               const int64_t *dims,
                                                               size_t dims_count, OrtValue **out);
  ORT_ABI_PAD(92, 92);
  /* 93 */ void (ORT_API_CALL *ReleaseStatus)(OrtStatus *status);
  ORT_ABI_PAD(94, 98);
  /* 99 */ void (ORT_API_CALL *ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo *info);
  ORT_ABI_PAD(100, 273);
  /* 274 (API 17): calls fn(user_data, i) for every i in [0, total) on the session's intra-op
     thread pool, grouping the indices into at most num_batch batches (0: the runtime picks);
     returns when all calls are done. fn has the platform's default calling convention. */
  OrtStatus *(ORT_API_CALL *KernelContext_ParallelFor)(const OrtKernelContext *ctx,
                                                       void (*fn)(void *user_data, size_t i),
                                                       size_t total, size_t num_batch,
                                                       void *user_data);
  /* Later slots exist in newer runtimes; we neither declare nor touch them. */
};

/* A custom op's schema and kernel callbacks, filled in by us and read by the runtime, which
 * reads a field only when `version` is at least the API version that introduced it. These are
 * the fields up to API 20; with version 17 the runtime stops at GetEndVersion. */
struct OrtCustomOp {
  uint32_t version;
  void *(ORT_API_CALL *CreateKernel)(const OrtCustomOp *op, const OrtApi *api,
                                     const OrtKernelInfo *info);
  const char *(ORT_API_CALL *GetName)(const OrtCustomOp *op);
  const char *(ORT_API_CALL *GetExecutionProviderType)(const OrtCustomOp *op);
  ONNXTensorElementDataType (ORT_API_CALL *GetInputType)(const OrtCustomOp *op, size_t i);
  size_t (ORT_API_CALL *GetInputTypeCount)(const OrtCustomOp *op);
  ONNXTensorElementDataType (ORT_API_CALL *GetOutputType)(const OrtCustomOp *op, size_t i);
  size_t (ORT_API_CALL *GetOutputTypeCount)(const OrtCustomOp *op);
  void (ORT_API_CALL *KernelCompute)(void *kernel, OrtKernelContext *ctx);
  void (ORT_API_CALL *KernelDestroy)(void *kernel);
  /* API 8 */
  OrtCustomOpInputOutputCharacteristic (ORT_API_CALL *GetInputCharacteristic)(
      const OrtCustomOp *op, size_t i);
  OrtCustomOpInputOutputCharacteristic (ORT_API_CALL *GetOutputCharacteristic)(
      const OrtCustomOp *op, size_t i);
  /* API 13 */
  OrtMemType (ORT_API_CALL *GetInputMemoryType)(const OrtCustomOp *op, size_t i);
  /* API 14 */
  int (ORT_API_CALL *GetVariadicInputMinArity)(const OrtCustomOp *op);
  int (ORT_API_CALL *GetVariadicInputHomogeneity)(const OrtCustomOp *op);
  int (ORT_API_CALL *GetVariadicOutputMinArity)(const OrtCustomOp *op);
  int (ORT_API_CALL *GetVariadicOutputHomogeneity)(const OrtCustomOp *op);
  /* API 16: used instead of CreateKernel / KernelCompute when set; they return a status. */
  OrtStatus *(ORT_API_CALL *CreateKernelV2)(const OrtCustomOp *op, const OrtApi *api,
                                            const OrtKernelInfo *info, void **kernel);
  OrtStatus *(ORT_API_CALL *KernelComputeV2)(void *kernel, OrtKernelContext *ctx);
  /* API 17 (all optional) */
  OrtStatus *(ORT_API_CALL *InferOutputShapeFn)(const OrtCustomOp *op,
                                                OrtShapeInferContext *ctx);
  int (ORT_API_CALL *GetStartVersion)(const OrtCustomOp *op);
  int (ORT_API_CALL *GetEndVersion)(const OrtCustomOp *op);
  /* Added after API 17, by API 20 (optional; unused, left NULL) */
  size_t (ORT_API_CALL *GetMayInplace)(int **input_index, int **output_index);
  void (ORT_API_CALL *ReleaseMayInplace)(int *input_index, int *output_index);
  size_t (ORT_API_CALL *GetAliasMap)(int **input_index, int **output_index);
  void (ORT_API_CALL *ReleaseAliasMap)(int *input_index, int *output_index);
};

#ifndef __cplusplus
#define ORT_ABI_SLOT(field, n) \
  _Static_assert(offsetof(OrtApi, field) == (n) * sizeof(void *), #field " must be slot " #n)
ORT_ABI_SLOT(CreateStatus, 0);
ORT_ABI_SLOT(GetErrorCode, 1);
ORT_ABI_SLOT(GetErrorMessage, 2);
ORT_ABI_SLOT(CreateCustomOpDomain, 26);
ORT_ABI_SLOT(CustomOpDomain_Add, 27);
ORT_ABI_SLOT(AddCustomOpDomain, 28);
ORT_ABI_SLOT(GetTensorMutableData, 51);
ORT_ABI_SLOT(GetDimensionsCount, 61);
ORT_ABI_SLOT(GetDimensions, 62);
ORT_ABI_SLOT(GetTensorTypeAndShape, 65);
ORT_ABI_SLOT(KernelInfoGetAttribute_float, 85);
ORT_ABI_SLOT(KernelInfoGetAttribute_int64, 86);
ORT_ABI_SLOT(KernelContext_GetInputCount, 88);
ORT_ABI_SLOT(KernelContext_GetOutputCount, 89);
ORT_ABI_SLOT(KernelContext_GetInput, 90);
ORT_ABI_SLOT(KernelContext_GetOutput, 91);
ORT_ABI_SLOT(ReleaseStatus, 93);
ORT_ABI_SLOT(ReleaseTensorTypeAndShapeInfo, 99);
ORT_ABI_SLOT(KernelContext_ParallelFor, 274);
_Static_assert(offsetof(OrtCustomOp, CreateKernelV2) == 17 * sizeof(void *),
               "OrtCustomOp: CreateKernelV2 follows the version word and 16 pointers");
_Static_assert(sizeof(OrtCustomOp) == 26 * sizeof(void *), "OrtCustomOp: u32 + 25 pointers");
#undef ORT_ABI_SLOT
#endif

#ifdef __cplusplus
}
#endif

#endif /* EDGESPEC_ORT_ABI_H */
