#pragma once
#include <c10/core/Allocator.h>

namespace c10 {
void SetCPUAllocator(Allocator* alloc, uint8_t priority = 0);
Allocator* GetCPUAllocator();
Allocator* GetDefaultCPUAllocator();
}  // namespace c10
