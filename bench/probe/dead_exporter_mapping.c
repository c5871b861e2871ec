// Probe (H100, driver 580, run R): after a legacy-IPC exporter is SIGKILLed, does a stream write
// into the importer's mapping of its memory complete, whether queued before or after the death?
// Answer there: yes, both (the memory lives while the importer maps it), the value reads back,
// and cuIpcCloseMemHandle then takes 0.1 ms. Build: nvcc -O2 -o /tmp/p dead_exporter_mapping.c -lcuda
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <sys/wait.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorName(r_, &s); printf("%s -> %s\n", #x, s); } } while (0)
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec + t.tv_nsec*1e-9; }
static const char* poll_stream(CUstream s, double secs){ double t0=now(); for(;;){ CUresult r=cuStreamQuery(s); if(r==CUDA_SUCCESS) return "done"; if(r!=CUDA_ERROR_NOT_READY){static char b[64]; const char*n; cuGetErrorName(r,&n); snprintf(b,64,"error %s",n); return b;} if(now()-t0>secs) return "STUCK"; usleep(200);} }
int main(int argc, char** argv){
  int queued_before = argc > 1 && !strcmp(argv[1], "queued");
  int p[2]; pipe(p);
  pid_t c = fork();
  if (c == 0) {
    cuInit(0); CUdevice d; cuDeviceGet(&d,0); CUcontext x; cuDevicePrimaryCtxRetain(&x,d); cuCtxSetCurrent(x);
    CUdeviceptr m; cuMemAlloc(&m, 1<<20); CUipcMemHandle h; cuIpcGetMemHandle(&h, m);
    write(p[1], &h, sizeof h); pause(); _exit(0);
  }
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d,0)); CUcontext x; CK(cuDevicePrimaryCtxRetain(&x,d)); CK(cuCtxSetCurrent(x));
  CUipcMemHandle h; read(p[0], &h, sizeof h);
  CUdeviceptr m; CK(cuIpcOpenMemHandle(&m, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
  CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CK(cuStreamWriteValue64(s, m, 1, 0)); printf("write before kill: %s\n", poll_stream(s, 2));
  CUdeviceptr gate; CK(cuMemAlloc(&gate, 64)); CK(cuMemsetD8(gate, 0, 64));
  if (queued_before) { CK(cuStreamWaitValue64(s, gate, 1, CU_STREAM_WAIT_VALUE_GEQ)); CK(cuStreamWriteValue64(s, m, 2, 0)); }
  kill(c, SIGKILL); int st; waitpid(c, &st, 0); usleep(300000);
  printf("exporter dead (%s)\n", queued_before ? "write queued before, gated" : "write after");
  if (queued_before) { CUstream s2; CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING)); CK(cuStreamWriteValue64(s2, gate, 1, 0)); printf("gate opened: %s\n", poll_stream(s2, 2)); }
  else CK(cuStreamWriteValue64(s, m, 3, 0));
  printf("write into dead exporter's mapping: %s\n", poll_stream(s, 3));
  CUstream s3; CK(cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING));
  unsigned long long v = 0; CK(cuMemcpyDtoHAsync(&v, m, 8, s3)); printf("read back on a new stream: %s value %llu\n", poll_stream(s3, 3), v);
  double t0 = now(); CK(cuIpcCloseMemHandle(m)); printf("close took %.1f ms\n", (now()-t0)*1e3);
  CUstream s4; CK(cuStreamCreate(&s4, CU_STREAM_NON_BLOCKING)); CK(cuMemsetD8Async(gate, 0, 8, s4)); printf("unrelated work after: %s\n", poll_stream(s4, 3));
  fflush(stdout); _exit(0);
}
