// Runtime API: streams, events, host functions, capture and graphs. Each _ptsz form is
// the plain form with 0 meaning the calling thread's per-thread default stream.
#include "runtime_state.h"

using namespace cudart;

extern "C" {

cudaError_t cudaStreamCreate(cudaStream_t* s) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuStreamCreate(s, CU_STREAM_DEFAULT));
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuStreamCreate(s, flags));
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuStreamCreateWithPriority(s, flags, priority));
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuStreamDestroy_v2(s));
}

#define CUDART_STREAM_PAIR(name, params, call_expr, ...)                 \
  cudaError_t name params {                                              \
    Api api(#name);                                                      \
    if (!api.ok()) return api.status();                                  \
    cudaStream_t s = stream_arg;                                         \
    return api.ret(call_expr);                                           \
  }                                                                      \
  cudaError_t name##_ptsz params {                                       \
    Api api(#name "_ptsz");                                              \
    if (!api.ok()) return api.status();                                  \
    cudaStream_t s = per_thread(stream_arg);                             \
    return api.ret(call_expr);                                           \
  }

#define stream_arg stream
CUDART_STREAM_PAIR(cudaStreamSynchronize, (cudaStream_t stream), cuStreamSynchronize(s))
CUDART_STREAM_PAIR(cudaStreamQuery, (cudaStream_t stream), cuStreamQuery(s))
CUDART_STREAM_PAIR(cudaStreamWaitEvent, (cudaStream_t stream, cudaEvent_t e, unsigned int flags),
                   cuStreamWaitEvent(s, e, flags))
CUDART_STREAM_PAIR(cudaEventRecord, (cudaEvent_t e, cudaStream_t stream), cuEventRecord(e, s))
CUDART_STREAM_PAIR(cudaEventRecordWithFlags, (cudaEvent_t e, cudaStream_t stream, unsigned int flags),
                   flags ? CUDA_ERROR_INVALID_VALUE : cuEventRecord(e, s))
CUDART_STREAM_PAIR(cudaLaunchHostFunc, (cudaStream_t stream, cudaHostFn_t fn, void* data),
                   cuLaunchHostFunc(s, fn, data))
CUDART_STREAM_PAIR(cudaStreamAddCallback,
                   (cudaStream_t stream, cudaStreamCallback_t cb, void* data, unsigned int flags),
                   cuStreamAddCallback(s, reinterpret_cast<CUstreamCallback>(cb), data, flags))
CUDART_STREAM_PAIR(cudaStreamBeginCapture, (cudaStream_t stream, cudaStreamCaptureMode mode),
                   cuStreamBeginCapture_v2(s, static_cast<CUstreamCaptureMode>(mode)))
CUDART_STREAM_PAIR(cudaStreamEndCapture, (cudaStream_t stream, cudaGraph_t* graph), cuStreamEndCapture(s, graph))
CUDART_STREAM_PAIR(cudaStreamIsCapturing, (cudaStream_t stream, cudaStreamCaptureStatus* status),
                   cuStreamIsCapturing(s, reinterpret_cast<CUstreamCaptureStatus*>(status)))
CUDART_STREAM_PAIR(cudaStreamGetPriority, (cudaStream_t stream, int* priority), cuStreamGetPriority(s, priority))
CUDART_STREAM_PAIR(cudaStreamGetFlags, (cudaStream_t stream, unsigned int* flags), cuStreamGetFlags(s, flags))
CUDART_STREAM_PAIR(cudaStreamGetId, (cudaStream_t stream, unsigned long long* id), cuStreamGetId(s, id))
CUDART_STREAM_PAIR(cudaStreamGetDevice, (cudaStream_t stream, int* device), cuStreamGetDevice(s, device))
#undef stream_arg
#define stream_arg stream
CUDART_STREAM_PAIR(cudaGraphLaunch, (cudaGraphExec_t exec, cudaStream_t stream), cuGraphLaunch(exec, s))
#undef stream_arg
#undef CUDART_STREAM_PAIR

cudaError_t cudaEventCreate(cudaEvent_t* e) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuEventCreate(e, CU_EVENT_DEFAULT));
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  // cudaEventBlockingSync / DisableTiming / Interprocess have the driver's values.
  return api.ret(cuEventCreate(e, flags));
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuEventDestroy_v2(e));
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuEventQuery(e));
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuEventSynchronize(e));
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuEventElapsedTime_v2(ms, start, end));
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuThreadExchangeStreamCaptureMode(reinterpret_cast<CUstreamCaptureMode*>(mode)));
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuGraphInstantiateWithFlags(exec, graph, flags));
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags) {
  return cudaGraphInstantiate(exec, graph, flags);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuGraphExecDestroy(exec));
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  Api api(__func__);
  if (!api.ok()) return api.status();
  return api.ret(cuGraphDestroy(graph));
}

}  // extern "C"
